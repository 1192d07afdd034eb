"""Peak memory of a watched training step, and growth over many watched steps.

Usage::

    python benchmarks/memory.py                    # all models; growth over 1000 MLP steps
    python benchmarks/memory.py --quick            # growth over 100 steps
    python benchmarks/memory.py --growth-models mlp gpt2 --growth-steps 1000 --json mem.json
    python benchmarks/memory.py --device cuda

Issue 6 asks that a watched step's peak memory stay within 5% of the unwatched peak
(no retained activations) and that memory not grow over 1,000 watched steps.

How peak memory is measured
---------------------------
On CUDA the caching allocator counts for us: ``memory_allocated()`` at the step boundary
is what lives between steps; ``reset_peak_memory_stats()`` then
``max_memory_allocated()`` around the step is the peak.

On CPU there is no allocator statistic (``tracemalloc`` sees Python objects, not tensor
storage, and RSS hides frees inside glibc's arenas), so the peak is built from two
measurements, each exact for what it covers:

- *live*: bytes of every tensor reachable from Python at the step boundary, found by a
  ``gc`` scan and counted once per storage: parameters, gradients, optimizer state, the
  batch and whatever the watcher keeps. Nothing of autograd is alive at a boundary, so
  nothing is missed there.
- *transient peak*: the highest point, above the boundary, of the bytes the step itself
  allocated and had not yet freed. ``torch.profiler`` with ``profile_memory=True``
  reports every CPU-allocator allocation and free (size and time stamp); the profile
  spans two steps and only the second is read, because frees of blocks allocated before
  profiling began are not reported and the first step frees most of those (the previous
  gradients, say).

``peak = live + transient peak``, and the ratio column divides by the unwatched peak.
The same profile gives *retained*: bytes the second step allocated and never freed; a
watcher that holds activations past the step shows up there and in *live*. Buffers a
library allocates outside the tensor allocator (oneDNN scratch space) are invisible in
both the watched and the unwatched run.

How growth is measured
----------------------
One watch entry spans ``--growth-steps`` steps; after the first step, the middle one
and the last (each after ``gc.collect()``), the script records the process RSS and the
count and bytes of live tensors. The unwatched control shows the RSS drift that the
allocator produces by itself; tensor counts are exact and should not move at all.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from common import Column, add_run_arguments, footer_lines, format_header, progress_logger, start_run
from models import BUILDERS, Benchmark, build, default_models
from torch.profiler import ProfilerActivity, profile, record_function

MB = 2**20
GROWTH_COLUMNS = ("unwatched", "nan_magic", "nan_magic_ops")
PEAK_TARGET = 1.05


@dataclass
class StepMemory:
    """Memory of one steady-state step under one column, in bytes."""

    live: int
    transient_peak: int
    retained: int

    @property
    def peak(self) -> int:
        """Highest tensor memory during the step: live at the boundary + transient peak."""
        return self.live + self.transient_peak


@dataclass
class GrowthPoint:
    """Process and tensor memory after ``step`` watched steps."""

    step: int
    rss: int
    live_tensors: int
    live_bytes: int


@dataclass
class ModelMemory:
    """Everything measured for one model."""

    name: str
    description: str
    steps: dict[str, StepMemory] = field(default_factory=dict)
    growth: dict[str, list[GrowthPoint]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


def live_tensors(device: str) -> tuple[int, int]:
    """Count and bytes (once per storage) of the tensors on ``device`` that Python reaches."""
    count, storages = 0, {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which deprecated module
        # proxies (torch.distributed.reduce_op) answer with a warning.
        if not issubclass(type(obj), torch.Tensor) or obj.device.type != device:
            continue
        try:
            storage = obj.untyped_storage()
        except RuntimeError:  # tensors without storage (sparse, some subclasses)
            continue
        count += 1
        storages[storage.data_ptr()] = storage.nbytes()
    return count, sum(storages.values())


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; psutil elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


def _cpu_step_memory(bench: Benchmark) -> StepMemory:
    """Live bytes by gc scan, transient peak and retained bytes from the profiler timeline."""
    gc.collect()
    _, live = live_tensors("cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        bench.train_step()
        with record_function("measured_step"):
            bench.train_step()
    events = prof.profiler.kineto_results.events()
    start, end = next((e.start_ns(), e.end_ns()) for e in events if e.name() == "measured_step")
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    # Running total of bytes allocated since profiling began; read it at the step's
    # start, at its highest point inside the step and at its end.
    total, at_start, highest, at_end = 0, None, 0, 0
    for stamp, nbytes in allocations:
        if stamp > end:
            break
        if stamp >= start and at_start is None:
            at_start = highest = total
        total += nbytes
        if at_start is not None:
            highest = max(highest, total)
        at_end = total
    if at_start is None:  # the step allocated nothing at all
        return StepMemory(live, 0, 0)
    return StepMemory(live, highest - at_start, at_end - at_start)


def _cuda_step_memory(bench: Benchmark) -> StepMemory:
    """Live, peak and retained bytes from the CUDA caching allocator's counters."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    bench.train_step()
    torch.cuda.synchronize()
    peak, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    return StepMemory(before, peak - before, after - before)


def step_memory(bench: Benchmark, column: Column, device: str, warmup: int) -> StepMemory:
    """Memory of one steady-state step under ``column``, after ``warmup`` watched steps."""
    assert column.factory is not None
    with column.factory(bench.model):
        for _ in range(warmup):
            bench.train_step()
        if device == "cuda":
            return _cuda_step_memory(bench)
        return _cpu_step_memory(bench)


def growth(bench: Benchmark, column: Column, steps: int, device: str) -> list[GrowthPoint]:
    """RSS and live tensors after step 1, ``steps // 2`` and ``steps`` of one watch entry."""
    assert column.factory is not None
    marks = sorted({1, steps // 2, steps})
    points = []
    with column.factory(bench.model):
        for step in range(1, steps + 1):
            bench.train_step()
            if step in marks:
                gc.collect()
                count, nbytes = live_tensors(device)
                points.append(GrowthPoint(step, rss_bytes(), count, nbytes))
    return points


def measure_model(name: str, columns: list[Column], args: argparse.Namespace, log: Any) -> ModelMemory:
    """Step memory under every available column; growth for the nan_magic columns."""
    bench = build(name, args.device)
    result = ModelMemory(name, bench.description)
    # Gradients and optimizer state exist before any column is measured, as in a
    # training loop that has been running for a while.
    for _ in range(2):
        bench.train_step()
    for column in columns:
        if column.factory is None:
            continue
        try:
            result.steps[column.key] = step_memory(bench, column, args.device, args.warmup)
        except Exception as exc:  # a watcher that cannot run this model is a result
            if column.key == "unwatched":
                raise
            result.notes[column.key] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
    log(f"[{name}] step memory done")
    if name in args.growth_models:
        for column in columns:
            if column.key not in GROWTH_COLUMNS or column.key not in result.steps:
                continue
            log(f"[{name}] growth over {args.growth_steps} steps: {column.title}")
            try:
                result.growth[column.key] = growth(bench, column, args.growth_steps, args.device)
            except Exception as exc:
                result.notes[column.key + " growth"] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
    del bench
    gc.collect()
    return result


def format_tables(results: list[ModelMemory], columns: list[Column], device: str) -> str:
    """Peak ratio table, live/retained table, growth table and notes."""
    name_w = max(8, *(len(r.name) for r in results))
    widths = [max(len(c.title), 15) + 1 for c in columns]

    def row(label: str, cells: list[str]) -> str:
        return f"{label:<{name_w}}" + "".join(f"{cell:>{w}}" for cell, w in zip(cells, widths))

    header = row("model", [c.title for c in columns])
    rule = "-" * len(header)
    how = "CUDA allocator peak" if device == "cuda" else "live tensors + profiler transient peak"
    lines = [f"Peak tensor memory of a step / unwatched peak, [peak MB] ({how})", header, rule]
    for res in results:
        base = res.steps["unwatched"].peak
        cells = []
        for c in columns:
            m = res.steps.get(c.key)
            cells.append("n/a" if m is None else f"{m.peak / base:.3f} [{m.peak / MB:.0f}]")
        lines.append(row(res.name, cells))
    lines.append(row("target", [f"<= {PEAK_TARGET:.2f}" if c.key == "nan_magic" else "" for c in columns]))

    lines += ["", "Held between steps beyond unwatched / transient peak / retained by the step [MB]", header, rule]
    for res in results:
        base = res.steps["unwatched"].live
        cells = []
        for c in columns:
            m = res.steps.get(c.key)
            cells.append(
                "n/a" if m is None else f"{(m.live - base) / MB:+.1f}/{m.transient_peak / MB:.1f}/{m.retained / MB:.1f}"
            )
        lines.append(row(res.name, cells))

    grown = [(res, key, pts) for res in results for key, pts in res.growth.items()]
    if grown:
        lines += ["", "Growth within one watch entry (after step: RSS MB, live tensors, live MB)"]
        for res, key, pts in grown:
            title = next(c.title for c in columns if c.key == key)
            points = "  ".join(f"{p.step}: {p.rss / MB:.0f}, {p.live_tensors}, {p.live_bytes / MB:.1f}" for p in pts)
            # The second half is the verdict: bounded histories may fill during the first.
            half = pts[-2] if len(pts) > 2 else pts[0]
            lines.append(f"  {res.name:<{name_w}} {title:<14} {points}")
            lines.append(
                f"  {'':<{name_w}} {'':<14} second half: "
                f"RSS {(pts[-1].rss - half.rss) / MB:+.1f} MB, "
                f"tensors {pts[-1].live_tensors - half.live_tensors:+d}, "
                f"{(pts[-1].live_bytes - half.live_bytes) / MB:+.2f} MB"
            )

    lines += footer_lines(results, columns, name_w)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; ``--quick`` shortens the growth run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="growth over 100 steps, not 1000")
    p.add_argument("--models", nargs="+", choices=list(BUILDERS),
                   help="default: the four models, and gpt2_small with --device cuda")
    p.add_argument(
        "--growth-models",
        nargs="*",
        choices=list(BUILDERS),
        default=["mlp"],
        help="models whose growth is measured (default: mlp)",
    )
    p.add_argument("--growth-steps", type=int, help="steps per growth run (default 1000, quick 100)")
    p.add_argument("--warmup", type=int, default=2, help="watched steps before the measured one")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    add_run_arguments(p, pin_by_default=False)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--json", metavar="PATH", help="also write all measurements as JSON")
    args = p.parse_args(argv)
    if args.growth_steps is None:
        args.growth_steps = 100 if args.quick else 1000
    args.models = args.models or default_models(args.device)
    args.growth_models = [m for m in args.growth_models if m in args.models]
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure and print; progress goes to stderr."""
    args = parse_args(argv)
    info, columns = start_run(args)

    log = progress_logger()

    results = [measure_model(name, columns, args, log) for name in args.models]
    print("nan_magic memory: full training step (forward, loss, backward, optimizer step), "
          "fp32 (gpt2_small: bf16 autocast)")
    print(format_header(info) + "\n")
    print(format_tables(results, columns, args.device))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "args": vars(args), "models": [asdict(r) for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
