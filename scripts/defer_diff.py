"""Every incident row of the contract in one mode and its deferred twin: which rows' reports differ, and in what.

``defer=True`` is what a GPU runs; where it names less than the immediate watch, a GPU user gets the worse answer.
Run: ``PYTHONPATH=.:tests python scripts/defer_diff.py [--ops] [--only NAME,...] [--shard i/n] [--json FILE]``.
Not a timed test: it runs ~530 rows twice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections import Counter
from typing import Any

import torch
from contract import all_cases

import nan_magic
from nan_magic import NonFiniteError


def _source(pointer: Any) -> Any:
    return None if pointer is None else (os.path.basename(pointer.filename), pointer.lineno)


def summary(report: Any) -> dict[str, Any]:
    """What a user reads off a report: where, what, why, and whether the evidence parts are there."""
    return {
        "module": report.module, "phase": report.phase, "step": report.step, "op": report.op,
        "source": _source(report.source), "cause": None if report.cause is None else report.cause.label,
        "reproduced": report.reproduced, "tensor": str(report.tensor),
        "has_histograms": bool(report.samples), "has_fixes": bool(report.fixes),
        "verified_fix": any(getattr(f, "finite", False) for f in report.fixes),
        "debug_frame": _source(report.debug_frame),
    }


def run(case: Any, options: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    scenario = case.build()
    try:
        with nan_magic.watch(*scenario.targets, **options, **scenario.options):
            scenario.run()
    except NonFiniteError as error:
        return summary(error.report)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:200]}
    return {"error": "no report"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", action="store_true", help="compare ops=True with ops=True, defer=True")
    parser.add_argument("--only", default="", help="comma-separated row names")
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    index, count = map(int, args.shard.split("/"))
    base = {"ops": True} if args.ops else {}
    mode = "ops" if args.ops else "defer"
    cases = [c for c in all_cases() if c.expect is not None and (mode in c.modes or (args.ops and "ops" in c.modes))]
    if args.only:
        names = set(args.only.split(","))
        cases = [c for c in cases if c.name in names]
    cases = cases[index::count]
    differing: dict[str, dict[str, Any]] = {}
    by_field: Counter[str] = Counter()
    for n, case in enumerate(cases):
        now, late = run(case, base), run(case, {**base, "defer": True})
        fields = sorted(k for k in set(now) | set(late) if now.get(k) != late.get(k))
        if fields:
            differing[case.name] = {k: (now.get(k), late.get(k)) for k in fields}
            by_field.update(fields)
            print(f"[{n}] {case.name}: " + "; ".join(f"{k} {now.get(k)!r} -> {late.get(k)!r}" for k in fields),
                  flush=True)
    print(f"rows compared {len(cases)}, rows differing {len(differing)}; by field {dict(by_field)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"compared": len(cases), "differing": differing, "by_field": by_field}, out, indent=1,
                      default=str)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
