"""How much of the package runs on a healthy step: the hot path's size in lines, by module.

Usage::

    python benchmarks/hot_lines.py            # the three launch-bound models, both timings, ~1 min
    python benchmarks/hot_lines.py --all      # every module, not only those with a line on the hot path

Why: issue 25 asks for a hot path "readable in one sitting", separate from the cold
localizer. Which code is hot is a fact to measure, not a folder name: this runs each
launch-bound model (models.py) under the default watch, immediate and deferred, and
records every function of nan_magic called during the steady steps (after the
watch's first steps, over a window holding the per-module and parameter-check steps
the tiered watch runs at its cadences). A function called there counts with all its
lines (its cold branches too: an upper bound); a function never called counts as cold.
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib
import sys

import torch
from models import LAUNCH_BOUND, build_launch_bound

SETTLE = 60
STEPS = 200
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "nan_magic"


def _called(steps: int) -> set[tuple[str, str]]:
    """(module path, function name) of every nan_magic function called in the steady steps."""
    import nan_magic

    called: set[tuple[str, str]] = set()

    def profile(frame: object, event: str, _arg: object) -> None:
        if event == "call":
            filename = frame.f_code.co_filename  # type: ignore[attr-defined]
            if "nan_magic/" in filename:
                called.add((filename.split("nan_magic/")[-1], frame.f_code.co_name))  # type: ignore[attr-defined]

    for name in LAUNCH_BOUND:
        for defer in (False, True):
            torch.manual_seed(0)
            bench = build_launch_bound(name)
            with nan_magic.watch(bench.model, bench.optimizer, defer=defer):
                for _ in range(SETTLE):
                    bench.train_step()
                sys.setprofile(profile)
                try:
                    for _ in range(steps):
                        bench.train_step()
                finally:
                    sys.setprofile(None)
    return called


def _function_lines(called: set[tuple[str, str]]) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Lines of function bodies per module: all of them, and those of functions called on the hot path."""
    total: collections.Counter[str] = collections.Counter()
    hot: collections.Counter[str] = collections.Counter()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                total[module] += lines
                if (module, node.name) in called:
                    hot[module] += lines
    return total, hot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="list every module, hot lines or not")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    total, hot = _function_lines(_called(args.steps))
    print("Lines of nan_magic's functions called on a healthy step (tiny_lm, deep_mlp, small_cnn; immediate and "
          f"deferred; steps {SETTLE}-{SETTLE + args.steps}), by module: hot / all function lines")
    for module in sorted(total, key=lambda m: (-hot[m], -total[m])):
        if hot[module] or args.all:
            print(f"{hot[module]:6d} / {total[module]:5d}  {module}")
    folders: collections.Counter[str] = collections.Counter()
    for module, lines in hot.items():
        folders[module.split("/")[0] if "/" in module else "(top level)"] += lines
    print("by folder: " + ", ".join(f"{folder} {lines}" for folder, lines in folders.most_common()))
    print(f"hot: {sum(hot.values())} of {sum(total.values())} function lines "
          f"({sum(hot.values()) / sum(total.values()):.0%}) in {sum(1 for m in hot if hot[m])} modules")


if __name__ == "__main__":
    main()
