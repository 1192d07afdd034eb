"""What the benchmark scripts share: the watcher columns and the machine header.

A *column* is one way of running the training step: unwatched, under nan_magic (default
and ops mode) or under one of the comparison watchers of :mod:`baselines`. Each column
is a factory ``model -> context manager``; the scripts enter it around a block of steps,
the way a notebook cell wraps its training loop.

The nan_magic columns go through the public API only (``nan_magic.watch``). When the
package or ``watch`` cannot be imported, those columns carry the reason and the scripts
print ``n/a`` for them instead of failing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import baselines
import torch
from torch import nn

WatchFactory = Callable[[nn.Module], AbstractContextManager[Any]]


@dataclass(frozen=True)
class Column:
    """One way of running the step.

    Attributes
    ----------
    key:
        Stable identifier used in JSON output and on the command line.
    title:
        Header in the printed tables.
    factory:
        ``factory(model)`` returns the context manager to run the steps under, or None
        when the column cannot run here (see ``unavailable``).
    unavailable:
        Why the column cannot run (import error...), or None.
    """

    key: str
    title: str
    factory: WatchFactory | None
    unavailable: str | None = None


def _unwatched(model: nn.Module) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def _nan_magic_columns() -> list[Column]:
    """The nan_magic columns (the tiered default, mode="full", ops=True), or ``n/a`` columns saying why not."""
    titles = {"nan_magic": "nan_magic", "nan_magic_full": "nan_magic full", "nan_magic_ops": "nan_magic ops"}
    try:
        import nan_magic

        watch = nan_magic.watch
    except (ImportError, AttributeError) as exc:
        reason = f"nan_magic.watch unavailable: {type(exc).__name__}: {exc}"
        return [Column(key, title, None, reason) for key, title in titles.items()]

    def default(model: nn.Module) -> AbstractContextManager[Any]:
        return watch(model)

    def full(model: nn.Module) -> AbstractContextManager[Any]:
        return watch(model, mode="full")

    def ops(model: nn.Module) -> AbstractContextManager[Any]:
        return watch(model, ops=True)

    return [
        Column("nan_magic", titles["nan_magic"], default),
        Column("nan_magic_full", titles["nan_magic_full"], full),
        Column("nan_magic_ops", titles["nan_magic_ops"], ops),
    ]


def all_columns() -> list[Column]:
    """Every column, in table order: unwatched first (the denominator of every ratio)."""
    return [
        Column("unwatched", "unwatched", _unwatched),
        *_nan_magic_columns(),
        Column("isnan_hook", "isnan hook", baselines.naive_isnan_hooks),
        Column("debug_uo", "DebugUO", baselines.debug_underflow_overflow),
        Column("anomaly", "anomaly", baselines.anomaly_detection),
        Column("naive_dispatch", "naive ops", baselines.naive_dispatch_checker),
        Column("floor", "reads floor", baselines.checks_floor),
        Column("boundary_floor", "boundary floor", baselines.boundary_floor),
    ]


def watch_options(pairs: list[str]) -> dict[str, Any]:
    """``--option NAME=VALUE`` arguments as ``watch()``'s keyword arguments (VALUE a Python literal, else a string).

    Raises ValueError for a pair that is not ``NAME=VALUE``, and for ``defer`` (the scripts' own ``--defer``).
    """
    import ast

    parsed: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier() or name == "defer":
            raise ValueError(f"--option takes NAME=VALUE (not defer: use --defer), not {pair!r}")
        try:
            parsed[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed[name] = value
    return parsed


def setup_torch(threads: int) -> None:
    """Pin the intra-op thread count, so timings do not depend on the default pool size."""
    torch.set_num_threads(threads)


# mallopt() parameters from glibc's <malloc.h>.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def pin_malloc() -> str:
    """Fix glibc's heap thresholds so that a step's time does not flip between two modes.

    glibc moves its mmap and trim thresholds as blocks are freed; depending on which
    small allocations happen to sit at the top of the heap, the multi-megabyte
    weight-sized tensors of a step are either reused or handed back to the kernel and
    page-faulted in again on every step. On the MLP that alone moves an *unwatched*
    step between about 35 and 47 ms from one block of steps to the next (measured on
    the 2-core benchmark machine), an effect of heap layout, not of any watcher. With
    the thresholds fixed (no mmap, no trim), every column keeps its memory and the
    ratios measure the watchers. ``--malloc default`` measures without this.

    Returns a one-line description for the table header.
    """
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return "default (mallopt unavailable)"
    ok = all(
        mallopt(option, value)
        for option, value in ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    )
    return "glibc, heap thresholds pinned (no mmap, no trim)" if ok else "default (mallopt refused)"


def machine_info(device: str) -> dict[str, Any]:
    """Facts needed to compare runs: CPU, threads, torch and Python versions, device."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": device,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def format_header(info: dict[str, Any]) -> str:
    """One or two lines describing the machine, for the top of every table."""
    line = (
        f"machine: {info['cpu']}, {info['cpu_count']} CPUs "
        f"({info['cpu_affinity']} usable), torch threads {info['torch_threads']}\n"
        f"software: torch {info['torch']}, Python {info['python']}, {info['platform']}\n"
        f"device: {info['device']}"
    )
    if info.get("malloc"):
        line += f"\nallocator: {info['malloc']}"
    if info["load_average"] is not None:
        # Other processes on a shared machine are the main source of noise: say so.
        line += "\nload average before the run (1/5/15 min): " + " ".join(f"{x:.2f}" for x in info["load_average"])
    if info["device"] == "cuda":
        line += f" ({info['gpu']}, CUDA {info['cuda']})"
    return line


def progress_logger() -> Callable[[str], None]:
    """A ``log(message)`` that prints to stderr with the seconds since it was made."""
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"{time.perf_counter() - started:6.1f}s {message}", file=sys.stderr, flush=True)

    return log


def footer_lines(results: list[Any], columns: list[Column], name_w: int) -> list[str]:
    """The tables' common end: each model's description, then notes (unavailable columns, cut runs)."""
    lines = ["", "Models:"] + [f"  {r.name:<{name_w}} {r.description}" for r in results]
    notes = [f"  {c.title}: n/a: {c.unavailable}" for c in columns if c.unavailable]
    notes += [f"  {r.name}: {k}: {v}" for r in results for k, v in r.notes.items()]
    if notes:
        lines += ["", "Notes:", *notes]
    return lines


def add_run_arguments(parser: Any, *, pin_by_default: bool) -> None:
    """``--columns`` and ``--malloc``, shared by both scripts."""
    parser.add_argument(
        "--columns", nargs="+", choices=[c.key for c in all_columns()[1:]],
        help="only these columns (unwatched always runs: it is the denominator)",
    )
    parser.add_argument(
        "--malloc", choices=["pinned", "default"], default="pinned" if pin_by_default else "default",
        help=f"pin glibc's heap thresholds or leave them moving (default: {'pinned' if pin_by_default else 'default'}"
        "; see common.pin_malloc)",
    )


def start_run(args: Any) -> tuple[dict[str, Any], list[Column]]:
    """Pin the heap if asked, set the threads; the machine facts and the columns to run."""
    malloc = pin_malloc() if args.malloc == "pinned" else "default"
    setup_torch(args.threads)
    info = machine_info(args.device)
    info["malloc"] = malloc
    columns = [c for c in all_columns() if c.key == "unwatched" or not args.columns or c.key in args.columns]
    return info, columns
