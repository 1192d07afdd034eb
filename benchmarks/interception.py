"""What it costs to see each op of the loss code, by the way it is intercepted: microseconds per op.

Usage::

    python benchmarks/interception.py            # about 20 s
    python benchmarks/interception.py --ops 80   # a longer loss code

Why (issue 25, item 1: "decide what the loss-code region costs in the hot path"): the
default watch records the ops between a model's return and ``backward()``
(localize/outside/recorder.py) so that a loss-code producer is named by its op and line.
The recorder is a Python dispatch mode, and every op of that code then passes through
torch's Python dispatch machinery, whatever the mode does with it. This script separates
the two: the recorder against a dispatch mode that only calls the op, and both against a
function mode (``TorchFunctionMode``), which sees each call of a torch function (one
``F.cross_entropy`` where the dispatch level sees a ``log_softmax`` and an ``nll_loss``)
before dispatch.

Method: a loss code of N elementwise ops on a small tensor (``y * 1.0001 + 0.0001``, 2N ops
and N torch-function calls of each kind) runs under each way of seeing it; the time per op is
the best of R repeats of K runs (the minimum: what the code costs when nothing else runs),
less the same code unwatched, over the ops it ran. One CPU thread.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from nan_magic.localize.outside.recorder import OutsideRecorder
from nan_magic.records import KINDS


class _PassDispatch(TorchDispatchMode):
    """A dispatch mode that only calls the op: torch's own cost of a Python dispatch mode."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _PassFunction(TorchFunctionMode):
    """A function mode that only calls the function: torch's own cost of a Python function mode."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _Recording:
    """The watch's recorder, as the default watch runs it for a loss region."""

    def __init__(self) -> None:
        self.recorder = OutsideRecorder(frozenset(KINDS))

    def __enter__(self) -> None:
        self.recorder.start("loss")

    def __exit__(self, *_exc: object) -> None:
        self.recorder.stop()
        self.recorder.forget()


def per_op_us(context: Callable[[], Any], ops: int, runs: int, repeats: int) -> float:
    """Best time of one run of the loss code under ``context()``, in microseconds per dispatched op."""
    x = torch.randn(8, 16, requires_grad=True)

    def loss_code() -> torch.Tensor:
        y = x
        for _ in range(ops):
            y = y * 1.0001 + 0.0001
        return y

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(runs):
            with context():
                loss_code()
        best = min(best, (time.perf_counter() - start) / runs)
    return best / (2 * ops) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=40, help="elementwise lines of loss code (2 ops each)")
    parser.add_argument("--runs", type=int, default=200, help="runs timed together")
    parser.add_argument("--repeats", type=int, default=9, help="the best of this many")
    options = parser.parse_args()
    for name in ("ops", "runs", "repeats"):
        if getattr(options, name) <= 0:
            parser.error(f"--{name} must be positive, not {getattr(options, name)}")
    torch.set_num_threads(1)
    columns: list[tuple[str, Callable[[], Any]]] = [
        ("unwatched", contextlib.nullcontext),
        ("dispatch mode, passing the op", _PassDispatch),
        ("nan_magic's recorder (dispatch mode)", _Recording),
        ("function mode, passing the call", _PassFunction),
    ]
    times = {name: per_op_us(make, options.ops, options.runs, options.repeats) for name, make in columns}
    base = times["unwatched"]
    print(f"Seeing each op of a loss code of {2 * options.ops} elementwise ops ({options.ops} lines); "
          "CPU, one thread; best of "
          f"{options.repeats} x {options.runs} runs")
    print(f"{'way of seeing the ops':<40} {'us/op':>7} {'added':>7}")
    for name, value in times.items():
        print(f"{name:<40} {value:>7.2f} {value - base:>+7.2f}")
    print("added: microseconds per op over the unwatched code; a function mode sees one call per torch function "
          "(here one per op)")


if __name__ == "__main__":
    main()
