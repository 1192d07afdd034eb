"""Time a full training step under each watcher, interleaved in one process; print ratios.

Usage::

    python benchmarks/step_overhead.py                 # full run, under 10 min on 2 cores
    python benchmarks/step_overhead.py --quick         # about one minute
    python benchmarks/step_overhead.py --models mlp gpt2 --json out.json
    python benchmarks/step_overhead.py --device cuda   # GPU: also counts host syncs per step

Method (issue 6): for each model, every column (unwatched, nan_magic, nan_magic ops and
the baselines of :mod:`baselines`) first runs a warm-up block. Then come R rounds; in
each round every column runs one block of K training steps, in an order rotated by one
column per round, so that no column always runs first, last or after the same
neighbour. A block enters the watcher once and runs K steps inside it, as a notebook cell
wraps its loop, so attach/detach costs are included but amortised over K steps.

A column's step time in a round is its block time / K. Its ratio in a round is that time
over the unwatched time *of the same round*: pairing neighbours in time cancels slow drift
of the machine (thermal, other tenants). The table gives the median of the per-round
ratios, ± half their inter-quartile range, and below it the median step time in ms.

K and R are chosen per model from the warm-up timings so that each model's rounds take
about ``--budget`` seconds; slow columns therefore lower K rather than the run's
predictability.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from common import Column, all_columns, format_header, machine_info, setup_torch, sync_fn
from models import BUILDERS, Benchmark, build

SYNC_WARNING = "called a synchronizing CUDA operation"
# CUDA runtime calls that block the host until the device catches up. cudaMemcpy (not
# Async) blocks too; kernel launches and async copies do not.
SYNC_RUNTIME_CALLS = (
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
)
TARGETS = {"nan_magic": 1.05, "nan_magic_ops": 2.0}


@dataclass
class ModelResult:
    """Everything measured for one model; the JSON output is a list of these."""

    name: str
    description: str
    steps_per_block: int = 0
    rounds: int = 0
    # round index -> column key -> seconds per step in that round's block
    step_s: list[dict[str, float]] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    # column key -> {"warnings": syncs/step, "runtime": syncs/step or None}
    syncs: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def ratios(self, key: str) -> list[float]:
        """Per-round step-time ratios of column ``key`` to the unwatched column."""
        return [r[key] / r["unwatched"] for r in self.step_s if key in r and "unwatched" in r]

    def median_ms(self, key: str) -> float | None:
        """Median step time of column ``key`` in milliseconds, None if it never ran."""
        times = [r[key] for r in self.step_s if key in r]
        return statistics.median(times) * 1e3 if times else None


def run_block(bench: Benchmark, column: Column, steps: int, sync: Any) -> float:
    """Run ``steps`` training steps inside one entry of ``column``; seconds per step."""
    assert column.factory is not None
    sync()
    start = time.perf_counter()
    with column.factory(bench.model):
        for _ in range(steps):
            bench.train_step()
    sync()
    return (time.perf_counter() - start) / steps


def describe_failure(column: Column, exc: BaseException) -> str:
    """The note printed for a column that raised instead of running."""
    if isinstance(exc, NotImplementedError) or (
        column.key == "nan_magic_ops" and isinstance(exc, TypeError) and "ops" in str(exc)
    ):
        return f"skipped, ops mode not available: {type(exc).__name__}: {exc}"
    return f"failed: {type(exc).__name__}: {exc}".splitlines()[0]


def count_syncs(bench: Benchmark, column: Column, steps: int) -> dict[str, float | None]:
    """Host synchronisations per steady-state training step under ``column`` (CUDA only).

    Two independent counts, because neither sees everything:

    - ``warnings``: ``torch.cuda.set_sync_debug_mode("warn")`` makes every sync that
      PyTorch itself performs (``.item()``, ``bool(t)``, ``.cpu()``, ``nonzero``,
      ``stream_synchronize``...) raise a UserWarning; C++ warnings from the autograd
      worker thread are replayed on the calling thread at the end of ``backward``, so
      backward-hook syncs are counted too. A sync made behind PyTorch's back (a raw
      ``cudaDeviceSynchronize`` from an extension, ``torch.cuda.synchronize()``) is not.
    - ``runtime``: the profiler's record of CUDA runtime calls that block the host
      (:data:`SYNC_RUNTIME_CALLS`), which sees those too; None if the profiler fails.

    The watcher is entered and given one step before counting starts and left after
    it ends, so the numbers are per steady-state step, without attach/detach.
    """
    assert column.factory is not None
    counts: dict[str, float | None] = {}
    with column.factory(bench.model):
        bench.train_step()
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    bench.train_step()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        counts["warnings"] = sum(SYNC_WARNING in str(w.message) for w in caught) / steps
        torch.cuda.synchronize()
        try:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(steps):
                    bench.train_step()
            # Kineto names runtime calls after the API, sometimes with a version suffix
            # (cudaMemcpy_v3020); cudaMemcpyAsync must not match cudaMemcpy.
            calls = sum(
                e.count for e in prof.key_averages()
                if any(e.key == name or e.key.startswith(name + "_v") for name in SYNC_RUNTIME_CALLS)
            )
            counts["runtime"] = calls / steps
        except RuntimeError:
            counts["runtime"] = None
    return counts


def measure_model(
    name: str, columns: list[Column], args: argparse.Namespace, log: Any
) -> ModelResult:
    """Warm up, choose K and R, run the interleaved rounds and (CUDA) count syncs."""
    bench = build(name, args.device)
    sync = sync_fn(args.device)
    result = ModelResult(name, bench.description)
    active = []
    for column in columns:
        if column.factory is None:
            result.notes[column.key] = f"n/a: {column.unavailable}"
        else:
            active.append(column)

    warm_s: dict[str, float] = {}
    for column in list(active):
        try:
            warm_s[column.key] = run_block(bench, column, args.warmup, sync)
        except Exception as exc:  # a watcher that cannot run this model is a result, not a crash
            if column.key == "unwatched":
                raise
            result.notes[column.key] = describe_failure(column, exc)
            active.remove(column)

    # One round costs K * sum(step times); fit R rounds in the budget, K >= 1, and
    # drop rounds (not below 3, for a median) only when even K = 1 does not fit.
    round_s = sum(warm_s.values())
    steps = max(1, int(args.budget / (args.rounds * round_s)))
    rounds = args.rounds if args.rounds * round_s <= args.budget else max(3, int(args.budget / round_s))
    result.steps_per_block, result.rounds = steps, rounds
    log(f"[{name}] warm-up step ms: "
        + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in warm_s.items())
        + f"; K={steps} steps x R={rounds} rounds, about {rounds * steps * round_s:.0f} s")

    for r in range(rounds):
        shift = r % len(active)
        times: dict[str, float] = {}
        for column in active[shift:] + active[:shift]:
            try:
                times[column.key] = run_block(bench, column, steps, sync)
            except Exception as exc:
                if column.key == "unwatched":
                    raise
                result.notes[column.key] = f"in round {r}: " + describe_failure(column, exc)
                active.remove(column)
        result.step_s.append(times)

    if not all(torch.isfinite(p).all() for p in bench.model.parameters()):
        result.notes["model"] = "parameters became non-finite during the run: timings suspect"

    if args.device == "cuda":
        for column in active:
            try:
                result.syncs[column.key] = count_syncs(bench, column, args.sync_steps)
            except Exception as exc:
                result.notes[column.key + " syncs"] = describe_failure(column, exc)
    del bench
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def _cell(values: list[float]) -> str:
    if not values:
        return "n/a"
    median = statistics.median(values)
    if len(values) < 2:
        return f"{median:.3f}"
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"{median:.3f}±{(q3 - q1) / 2:.3f}"


def format_tables(results: list[ModelResult], columns: list[Column], device: str) -> str:
    """The ratio table, the absolute-time table, the sync table (CUDA) and the notes."""
    name_w = max(8, *(len(r.name) for r in results))
    widths = [max(len(c.title), 12) + 1 for c in columns]

    def row(label: str, cells: list[str]) -> str:
        return f"{label:<{name_w}}" + "".join(f"{cell:>{w}}" for cell, w in zip(cells, widths))

    header = row("model", [c.title for c in columns])
    lines = [
        "Step time / unwatched step time: median of per-round ratios ± half the IQR",
        header,
        "-" * len(header),
    ]
    per_model: dict[str, list[float]] = {c.key: [] for c in columns}
    for res in results:
        cells = []
        for c in columns:
            ratios = res.ratios(c.key)
            cells.append(_cell(ratios))
            if ratios:
                per_model[c.key].append(statistics.median(ratios))
        lines.append(row(res.name, cells))
    lines.append("-" * len(header))
    medians = {k: statistics.median(v) if v else None for k, v in per_model.items()}
    lines.append(row("median", ["n/a" if medians[c.key] is None else f"{medians[c.key]:.3f}" for c in columns]))
    lines.append(row("target", [f"<= {TARGETS[c.key]:.2f}" if c.key in TARGETS else "" for c in columns]))
    verdicts = []
    for c in columns:
        m = medians[c.key]
        verdicts.append("" if c.key not in TARGETS else "n/a" if m is None
                        else "PASS" if m <= TARGETS[c.key] else "FAIL")
    lines.append(row("verdict", verdicts))

    lines += ["", "Median step time [ms] (K steps per block x R rounds)", header + "     K   R",
              "-" * (len(header) + 10)]
    for res in results:
        cells = [f"{ms:.1f}" if (ms := res.median_ms(c.key)) is not None else "n/a" for c in columns]
        lines.append(row(res.name, cells) + f"{res.steps_per_block:>6}{res.rounds:>4}")

    if device == "cuda":
        lines += ["", "Host syncs per training step (sync-debug-mode warnings / CUDA runtime sync calls)",
                  header, "-" * len(header)]
        for res in results:
            cells = []
            for c in columns:
                s = res.syncs.get(c.key)
                if s is None:
                    cells.append("n/a")
                else:
                    rt = "n/a" if s["runtime"] is None else f"{s['runtime']:g}"
                    cells.append(f"{s['warnings']:g} / {rt}")
            lines.append(row(res.name, cells))
        lines.append(row("target", ["<= 1" if c.key == "nan_magic" else "" for c in columns]))

    lines += ["", "Models:"] + [f"  {r.name:<{name_w}} {r.description}" for r in results]
    notes = [f"  {r.name}: {k}: {v}" for r in results for k, v in r.notes.items()]
    if notes:
        lines += ["", "Notes:"] + notes
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; ``--quick`` only changes the defaults of the timing knobs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="about one minute instead of ~8")
    p.add_argument("--models", nargs="+", choices=list(BUILDERS), default=list(BUILDERS))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--rounds", type=int, help="rounds per model (default 11, quick 3)")
    p.add_argument("--budget", type=float,
                   help="seconds of timed rounds per model (default 100, quick 6)")
    p.add_argument("--warmup", type=int, help="warm-up steps per column (default 2, quick 1)")
    p.add_argument("--sync-steps", type=int, default=10, help="CUDA steps counted for syncs")
    p.add_argument("--json", metavar="PATH", help="also write all measurements as JSON")
    args = p.parse_args(argv)
    for knob, full, quick in (("rounds", 11, 3), ("budget", 100.0, 6.0), ("warmup", 2, 1)):
        if getattr(args, knob) is None:
            setattr(args, knob, quick if args.quick else full)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the tables; progress goes to stderr."""
    args = parse_args(argv)
    setup_torch(args.threads)
    info = machine_info(args.device)
    columns = all_columns()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    started = time.perf_counter()
    results = [measure_model(name, columns, args, log) for name in args.models]
    elapsed = time.perf_counter() - started

    print("nan_magic step overhead: full training step (forward, loss, backward, optimizer "
          "step), fp32")
    print(format_header(info))
    print(f"run: {'quick' if args.quick else 'full'}, {elapsed:.0f} s\n")
    print(format_tables(results, columns, args.device))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "args": vars(args), "elapsed_s": elapsed,
                       "columns": [{"key": c.key, "title": c.title, "unavailable": c.unavailable}
                                   for c in columns],
                       "models": [asdict(r) for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
