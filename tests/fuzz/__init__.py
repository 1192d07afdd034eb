"""A differential fuzzer of incidents: generated training programs with one injected producer, truth by construction.

``generate.incident(seed)`` writes a Python source file (a model built from parts, a training loop, one producer of
a non-finite value at one site, armed at one step) and returns it with its :class:`~fuzz.generate.Truth`: the phase,
the module, the op, the line in that file and the step the report must name. ``run.judge`` runs the incident in the
contract's five modes exactly as ``tests/test_contract.py`` runs a row, and its healthy twin (the same file, not
armed), and says per mode what the report got right. ``python -m fuzz --seeds 0:300`` (from ``tests/``) runs a batch
and prints the disagreement classes; ``tests/test_fuzz_smoke.py`` runs a few fixed seeds in the test suite.
"""
