"""Run an incident in the contract's five modes, as ``tests/test_contract.py`` runs a row, and judge each report.

A mode's verdict is a tuple of the fields the report got wrong (``phase``, ``module``, ``step``, ``op``, ``line``),
or one word: ``missed`` (no report), ``crash`` (another exception), ``false-alarm`` / ``changed`` (the healthy
twin raised, or computed something else).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from contract import MODE_OPTIONS
from test_contract import same

import nan_magic
from fuzz.generate import Truth, incident
from nan_magic import NonFiniteError

MODES = tuple(MODE_OPTIONS)  # default, defer, full, ops, ops-defer


@dataclass
class Verdict:
    truth: Truth
    wrong: dict[str, tuple[str, ...]] = field(default_factory=dict)  # mode -> fields wrong (empty: right)
    said: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # mode -> (phase, module, step, op, line)
    twin: dict[str, str] = field(default_factory=dict)  # mode -> "" or what went wrong

    def classes(self) -> list[str]:
        """One label per disagreement: ``<site>/<producer>: <mode>: <fields>``."""
        labels = [f"{self.truth.key()}: {mode}: {'+'.join(fields)}" for mode, fields in self.wrong.items() if fields]
        labels += [f"{self.truth.key()}: {mode}: twin {what}" for mode, what in self.twin.items() if what]
        return labels


def load(path: str) -> ModuleType:
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # inspect and linecache read the file by the module's name
    spec.loader.exec_module(module)
    return module


def _wrong(truth: Truth, report: Any) -> tuple[str, ...]:
    got = {"phase": report.phase, "module": report.module, "step": report.step, "op": report.op,
           "line": (os.path.basename(report.source.filename), report.source.lineno) if report.source else None}
    want = {"phase": truth.phase, "module": truth.module, "step": truth.step,
            "line": (os.path.basename(truth.path), truth.line)}
    wrong = [name for name, value in want.items() if got[name] != value]
    if report.op not in truth.ops:
        wrong.append("op")
    return tuple(wrong)


def judge(seed: int, directory: Path, twin: bool = True) -> Verdict:
    """Generate incident ``seed`` and run it (and its twin) in every mode."""
    truth = incident(seed, directory)
    source = load(truth.path)
    verdict = Verdict(truth)
    for mode in MODES:
        scenario = source.build(True)
        try:
            with nan_magic.watch(*scenario.targets, **MODE_OPTIONS[mode], **scenario.options):
                scenario.run()
        except NonFiniteError as caught:
            report = caught.report
            verdict.wrong[mode] = _wrong(truth, report)
            verdict.said[mode] = (report.phase, report.module, report.step, report.op,
                                  report.source.lineno if report.source else None)
        except Exception:
            verdict.wrong[mode] = ("crash",)
            verdict.said[mode] = (traceback.format_exc(limit=-3),)
        else:
            verdict.wrong[mode] = ("missed",)
    if twin:
        expected = source.build(False).run()
        for mode in MODES:
            scenario = source.build(False)
            try:
                with nan_magic.watch(*scenario.targets, **MODE_OPTIONS[mode], **scenario.options) as w:
                    got = scenario.run()
            except NonFiniteError as caught:
                verdict.twin[mode] = f"false-alarm: {caught.report.message}"
                continue
            except Exception as error:
                verdict.twin[mode] = f"crash: {error!r}"
                continue
            verdict.twin[mode] = "" if w.report is None and same(got, expected) else "changed"
    return verdict
