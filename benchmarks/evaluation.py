"""What an evaluation costs under the watch: ``torch.inference_mode()`` and ``torch.no_grad()``, watched vs unwatched.

Usage::

    python benchmarks/evaluation.py              # about 30 s
    python benchmarks/evaluation.py --layers 40  # a deeper MLP

Why (eval28): the loop code's recorder (localize/outside/recorder.py), pushed after an optimizer step to record
the next batch's code, could not be popped inside an ``inference_mode`` block (the block's end restores the
dispatch-key set it found), so it stayed on the stack, inert, and every op of the evaluation went through its
Python ``__torch_dispatch__``: a watched ``inference_mode`` evaluation cost about twice an unwatched one. A
``no_grad`` evaluation, where the recorder steps aside at the model call, is the reference for what the watch's
own checks cost.

Method: a 20-layer MLP (width 64, batch 32) trains one step, then evaluates B batches under the context; the time
of the evaluation alone is the best of R repeats (the minimum: what it costs when nothing else runs), unwatched and
inside one ``nan_magic.watch`` that trained the step before each evaluation. Besides the times, the ops of the
evaluation that reached the recorder's ``__torch_dispatch__`` (a count: steady on a busy machine). Last, a
training step under a dispatch mode the user enters inside the loop: its time, and the ops that mode counted
(unwatched and watched: equal where the watch's own ops are kept from it, lifecycle/users_modes.py). One CPU thread.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nan_magic
from nan_magic.localize.outside.recorder import OutsideRecorder

CONTEXTS: dict[str, Callable[[], Any]] = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _model(layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[module for _ in range(layers) for module in (nn.Linear(64, 64), nn.ReLU())])
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _evaluate(model: nn.Module, context: Callable[[], Any], batches: list[torch.Tensor]) -> float:
    """Seconds of one evaluation (the models' means summed, read as a number: what an evaluation loop does)."""
    start = time.perf_counter()
    with context():
        total = sum(model(x).mean().item() for x in batches)
    elapsed = time.perf_counter() - start
    assert total == total
    return elapsed


def measure(layers: int, batches: int, repeats: int, context_name: str, watched: bool) -> tuple[float, int]:
    """(best seconds of an evaluation, ops a recorder's ``__torch_dispatch__`` saw per evaluation)."""
    model, opt = _model(layers)
    x = torch.randn(32, 64)
    data = [torch.randn(32, 64) for _ in range(batches)]
    context = CONTEXTS[context_name]
    seen = [0]
    dispatch = OutsideRecorder.__torch_dispatch__

    def counted(self: OutsideRecorder, *args: Any, **kwargs: Any) -> Any:
        if counting[0]:
            seen[0] += 1
        return dispatch(self, *args, **kwargs)

    counting = [False]
    best = float("inf")
    OutsideRecorder.__torch_dispatch__ = counted  # type: ignore[method-assign]
    try:
        with nan_magic.watch(model, opt) if watched else contextlib.nullcontext():
            for repeat in range(repeats + 2):  # two to warm up
                _train_step(model, opt, x)
                counting[0] = repeat == 0
                elapsed = _evaluate(model, context, data)
                counting[0] = False
                if repeat >= 2:
                    best = min(best, elapsed)
    finally:
        OutsideRecorder.__torch_dispatch__ = dispatch  # type: ignore[method-assign]
    return best, seen[0]


class _Counting(TorchDispatchMode):
    """A user's dispatch mode entered inside the loop: counts the ops it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def measure_users_mode(layers: int, repeats: int, watched: bool) -> tuple[float, int]:
    """(best seconds of a training step under a user's counting mode entered inside the loop, ops it counted)."""
    model, opt = _model(layers)
    x = torch.randn(32, 64)
    best, ops = float("inf"), 0
    with nan_magic.watch(model, opt) if watched else contextlib.nullcontext():
        for repeat in range(repeats + 2):
            start = time.perf_counter()
            with _Counting() as counting:
                _train_step(model, opt, x)
            elapsed = time.perf_counter() - start
            if repeat >= 2:
                best, ops = min(best, elapsed), counting.ops
    return best, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"MLP of {args.layers} layers, {args.batches} batches an evaluation, best of {args.repeats}; torch "
          f"{torch.__version__}")
    print(f"{'context':<16}{'unwatched ms':>14}{'watched ms':>12}{'ratio':>8}{'recorder ops':>14}")
    for name in CONTEXTS:
        plain, _ = measure(args.layers, args.batches, args.repeats, name, watched=False)
        watched, ops = measure(args.layers, args.batches, args.repeats, name, watched=True)
        print(f"{name:<16}{plain * 1e3:>14.2f}{watched * 1e3:>12.2f}{watched / plain:>8.2f}{ops:>14}")
    plain, plain_ops = measure_users_mode(args.layers, args.repeats, watched=False)
    watched, watched_ops = measure_users_mode(args.layers, args.repeats, watched=True)
    print(f"\na training step under a dispatch mode the user entered inside the loop (eval28 item 2): unwatched "
          f"{plain * 1e3:.2f} ms, watched {watched * 1e3:.2f} ms, ratio {watched / plain:.2f}; ops the user's mode "
          f"counted: {plain_ops} unwatched, {watched_ops} watched")


if __name__ == "__main__":
    main()
