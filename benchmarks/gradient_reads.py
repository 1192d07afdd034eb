"""The step's fused reads, timed one by one: which way of reading the gradients (and the parameters) costs least.

Usage::

    python benchmarks/gradient_reads.py            # the three launch-bound models, ~2 min
    python benchmarks/gradient_reads.py small_cnn  # one of them

Per model (benchmarks/models.py, LAUNCH_BOUND; one thread), each way of reading its gradients is timed twice:

* alone: in a loop, on the gradients of one step (warm: what a microbenchmark sees);
* in the step: inside an optimizer step pre-hook of the watched training loop, where the watch's own read runs
  (after the backward: what the step pays). The ways run in turns, their order reversed each step.

Thread time (``time.thread_time``), so another process on the machine does not count; the in-step numbers still
move by 20-30% from run to run on a loaded machine: compare the ways within one run. The fourteenth round's
numbers and what they decided are in benchmarks/README.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from models import LAUNCH_BOUND, Benchmark, build_launch_bound

import nan_magic

_flatten = torch._C._nn.flatten_dense_tensors


def _ways(grads: list[torch.Tensor], kept: torch.Tensor, views: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    def flat_dot() -> object:  # the watch's (step_checks.py's _gradient_norms)
        flat = _flatten(grads)
        return torch.dot(flat, flat).sqrt_()

    def flat_dot_no_sqrt() -> object:  # the same, rooted on the host instead (not bit-exact: see the README)
        flat = _flatten(grads)
        return torch.dot(flat, flat)

    def kept_buffer() -> object:  # copied into a buffer kept between steps: no allocation, a copy_ per tensor
        torch._foreach_copy_(views, grads)
        return torch.dot(kept, kept).sqrt_()

    def foreach_norm() -> object:  # a norm per tensor, read as a list
        return torch._foreach_norm(grads, 2)

    def foreach_norm_stack() -> object:  # ... stacked into one tensor
        return torch.stack(torch._foreach_norm(grads, 2))

    def flat_vector_norm() -> object:  # one op for the norm (not the dot's rounding)
        return torch.linalg.vector_norm(_flatten(grads))

    found, one = torch.zeros(1), torch.ones(1)

    def scaler_check() -> object:  # GradScaler's fused check at scale 1: no norm, and it writes the gradients
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        return found

    return {name: way for name, way in locals().items() if callable(way)}


def _alone(ways: dict[str, Callable[[], object]], count: int = 2000) -> dict[str, float]:
    best = {}
    for name, way in ways.items():
        for _ in range(100):
            way()
        best[name] = min(_timed(way, count) for _ in range(3))
    return best


def _timed(way: Callable[[], object], count: int) -> float:
    start = time.thread_time()
    for _ in range(count):
        way()
    return (time.thread_time() - start) / count * 1e6


def _in_step(bench: Benchmark, parameters: list[torch.Tensor], kept: torch.Tensor, views: list[torch.Tensor],
             names: list[str], steps: int = 1000) -> dict[str, float]:
    """Each way's mean time in an optimizer step pre-hook of the watched loop (the ways in turns)."""
    spent = dict.fromkeys(names, 0.0)
    count = [0]

    def hook(_opt: object, _args: object, _kwargs: object) -> None:
        ways = _ways([p.grad for p in parameters], kept, views)
        order = names if count[0] % 2 else names[::-1]
        count[0] += 1
        with torch.no_grad():
            for way in order:
                start = time.thread_time()
                ways[way]()
                spent[way] += time.thread_time() - start

    for _ in range(20):
        bench.train_step()
    with nan_magic.watch(bench.model, bench.optimizer):
        for _ in range(50):
            bench.train_step()
        handle = bench.optimizer.register_step_pre_hook(hook)
        for _ in range(steps):
            bench.train_step()
        handle.remove()
    return {way: total / count[0] * 1e6 for way, total in spent.items()}


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    for name in names:
        bench = build_launch_bound(name)
        bench.train_step()
        parameters = [p for p in bench.model.parameters() if p.grad is not None]
        kept = torch.empty(sum(p.numel() for p in parameters))
        views = [view.view(p.shape) for view, p in zip(kept.split([p.numel() for p in parameters]), parameters)]
        with torch.no_grad():
            alone = _alone(_ways([p.grad for p in parameters], kept, views))
        in_step = _in_step(bench, parameters, kept, views, list(alone))
        print(f"{name}: {len(parameters)} gradients, {kept.numel()} elements; us, alone / in the step")
        for way in alone:
            print(f"  {way:20s} {alone[way]:7.1f} / {in_step[way]:7.1f}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(LAUNCH_BOUND))
