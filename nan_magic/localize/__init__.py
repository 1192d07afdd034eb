"""The cold path, run only at an event or in ``mode="full"``/``ops=True``: where a non-finite value was born.

Layers, each importing only those below it (pyproject.toml, contract ``localize``):

* ``producer.py``: the producer rule, judging one module output;
* ``op_origins.py``: the service that names the op behind a boundary's value;
* ``outside/``: the code between the model calls (loss, data, update code), recorded and run again;
* ``replay/``: a module call, a step, an optimizer step or a dataset's samples, run again;
* ``ops/``: the op tracer, its per-op plans and tables, and the deliberate infinities (masks).
"""
