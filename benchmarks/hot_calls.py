"""The hot path's size in Python calls per healthy step: a count, not a time, so it holds on a busy machine.

Usage::

    python benchmarks/hot_calls.py                      # the three launch-bound models, ~20 s
    python benchmarks/hot_calls.py --top 25             # and the 25 functions of ours called most
    python benchmarks/hot_calls.py --by file --top 15   # the same, by module
    python benchmarks/hot_calls.py --models             # only the loss-code and update regions' costs
    python benchmarks/hot_calls.py --defer              # the deferred mode's (CUDA's default, defer=True)
    python benchmarks/hot_calls.py --idioms             # what each idiom of a realistic loop adds, both modes
    python benchmarks/hot_calls.py --option replay=False --option fixes=False   # any watch() option, as a literal

Why: on the launch-bound step (launch_bound.py) the watch's cost is almost all Python
the interpreter runs per step, and the timings of a shared 2-core machine move by
30% between runs of the same code, which hides a change of 10%. The number of
function calls the watch adds to a step (cProfile's primitive calls, builtins and torch's
Python included) is the same on every run of the same code, and on this regime it
tracks the extra time (roughly 1 us a call), so a lever can be judged by it while the
machine is busy and timed later when it is quiet.

Method: per model, N training steps run unwatched and then under ``nan_magic.watch``
(after 60 watched steps, so the steady state is measured: the window holds one
per-module step of the tiered watch, as any 100 steps do), each under cProfile; the
extra calls per step are the difference of the totals over N. Calls of nan_magic's own
functions are listed with ``--top``. Beside them, the same count for the boundary floor of
baselines.py (the tiered watch's tier-1 reads with almost no Python: a probe of the batch
and of the output, the output gradient's sum, the fused gradient norms): what the watch
adds beyond it is its bookkeeping.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys

import baselines
import common
import torch
from models import LAUNCH_BOUND, build_launch_bound
from torch.nn.modules.module import register_module_forward_pre_hook

STEPS = 100
SETTLE = 60


def _profiled(step: object, steps: int) -> pstats.Stats:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()  # type: ignore[operator]
    profile.disable()
    return pstats.Stats(profile)


def _ours(stats: pstats.Stats, by: str) -> collections.Counter[str]:
    """Primitive calls of nan_magic's functions, by function or by module."""
    counts: collections.Counter[str] = collections.Counter()
    for (filename, _line, function), (primitive, *_rest) in stats.stats.items():  # type: ignore[attr-defined]
        if "nan_magic" in filename:
            module = filename.split("nan_magic/")[-1]
            counts[module if by == "file" else f"{module}:{function}"] += primitive
    return counts


#: Extra elementwise ops the loss-code probe adds between the model's return and ``backward()``.
LOSS_OPS = 40


def _loss_code_cost(steps: int, defer: bool) -> float:
    """Calls the watch adds per op of loss code.

    The model is one ``nn.Linear``: a step with :data:`LOSS_OPS` more
    ``h * 1.0001`` ops between the model's return and ``backward()``, less one
    without, per op (each recorded by localize/outside/recorder.py as any loss op is).
    """
    import nan_magic

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(4, 8)

    def step(ops: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model(batch)
        for _ in range(ops):
            out = out * 1.0001
        out.square().mean().backward()
        optimizer.step()

    def calls(ops: int) -> float:
        return _profiled(lambda: step(ops), steps).prim_calls / steps  # type: ignore[attr-defined]

    unwatched = calls(LOSS_OPS) - calls(0)
    with nan_magic.watch(model, optimizer, defer=defer):
        for _ in range(SETTLE):
            step(0)
        watched = calls(LOSS_OPS) - calls(0)
    return (watched - unwatched) / LOSS_OPS


def _clipping_cost(steps: int, defer: bool) -> float:
    """Calls the watch adds for a ``clip_grad_norm_`` between ``backward()`` and ``step()`` (the update region,
    localize/outside/loop_writes.py): deep_mlp's step with it, less one without."""
    import nan_magic

    bench = build_launch_bound("deep_mlp")

    def step(clip: bool) -> None:
        bench.optimizer.zero_grad(set_to_none=True)
        bench.loss_fn(bench.model, *bench.batch).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(bench.model.parameters(), 1.0)
        bench.optimizer.step()

    def calls(clip: bool) -> float:
        return _profiled(lambda: step(clip), steps).prim_calls / steps  # type: ignore[attr-defined]

    unwatched = calls(True) - calls(False)
    with nan_magic.watch(bench.model, bench.optimizer, defer=defer):
        for _ in range(SETTLE):
            step(True)
        watched = calls(True) - calls(False)
    return watched - unwatched


#: The idioms of a realistic training loop that the benchmarks' minimal step (zero_grad, forward, a one-line
#: loss, backward, step) leaves out, each with the region of the loop it runs in (localize/outside/).
IDIOMS = {
    "item": "loss.item() logged after the step (data)",
    "metric": "(logits.argmax(-1) == y).float().mean() (loss)",
    "clip": "clip_grad_norm_(params, 1.0) (update)",
    "scheduler": "a warm-up LambdaLR's step() after opt.step() (data; a new lr every step)",
    "zero_grad": "zero_grad(set_to_none=False) (data)",
    "accumulate": "two micro-batches a step, loss / 2 (loss; a model call waits a step)",
    "to_device": "the batch moved with .to(device, float32) (data)",
    "augment": "noise and a normalisation of the batch (data)",
    "scaler": "a GradScaler: scale(loss).backward(), step(opt), update() (loss, update, data)",
    "eval": "every 10th iteration a validation forward under no_grad, model.eval()/train()",
}


class RealisticLoop:
    """deep_mlp trained by a loop with some of :data:`IDIOMS`; :meth:`step` is one iteration (one micro-batch)."""

    def __init__(self, idioms: frozenset[str]) -> None:
        self.idioms = idioms
        self.bench = bench = build_launch_bound("deep_mlp")
        self.x, self.y = bench.batch
        # A batch as a DataLoader over numpy arrays gives it: float64, converted on its way to the device.
        self.x64 = self.x.double()
        self.mean, self.std = self.x.mean(0), self.x.std(0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(bench.optimizer, lambda step: min(1.0, (step + 1) / 1e4))
        # (On the CPU, fp32: the scale stays at its start, no step is skipped; the ops are those of a GPU loop's.)
        self.scaler = torch.amp.GradScaler("cpu") if "scaler" in idioms else None
        self.iteration = 0
        self.logged = 0.0

    def step(self) -> None:
        idioms, model, optimizer = self.idioms, self.bench.model, self.bench.optimizer
        micro = 2 if "accumulate" in idioms else 1
        if self.iteration % micro == 0:
            optimizer.zero_grad(set_to_none="zero_grad" not in idioms)
        x, y = (self.x64.to("cpu", torch.float32), self.y.to("cpu")) if "to_device" in idioms else (self.x, self.y)
        if "augment" in idioms:
            x = (x + 0.01 * torch.randn_like(x) - self.mean) / self.std
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        if "metric" in idioms:
            self.accuracy = (logits.argmax(-1) == y).float().mean()
        scaled = loss / micro if micro > 1 else loss
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        self.iteration += 1
        if "eval" in idioms and self.iteration % 10 == 0:
            model.eval()
            with torch.no_grad():
                self.validation = torch.nn.functional.cross_entropy(model(self.x), self.y)
            model.train()
        if self.iteration % micro:
            return
        if "clip" in idioms:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        if "scheduler" in idioms:
            self.scheduler.step()
        if "item" in idioms:
            self.logged = loss.item()


def _loop_calls(idioms: frozenset[str], steps: int, defer: bool | None) -> tuple[float, pstats.Stats]:
    """Calls per iteration of a :class:`RealisticLoop` (``defer`` None: unwatched), and the watched profile."""
    import nan_magic

    loop = RealisticLoop(idioms)
    if defer is None:
        for _ in range(5):
            loop.step()
        stats = _profiled(loop.step, steps)
    else:
        with nan_magic.watch(loop.bench.model, loop.bench.optimizer, defer=defer):
            for _ in range(SETTLE):
                loop.step()
            stats = _profiled(loop.step, steps)
    return stats.prim_calls / steps, stats  # type: ignore[attr-defined]


def _idioms_table(steps: int, top: int, by: str) -> None:
    """One row per idiom: the calls the watch adds per iteration of a loop with it, less of the minimal loop."""
    rows = [("minimal", frozenset()), *((name, frozenset({name})) for name in IDIOMS), ("all", frozenset(IDIOMS))]
    print(f"{'idiom':<11} {'immediate':>10} {'adds':>6} {'deferred':>10} {'adds':>6}  what (region)")
    base: dict[bool, tuple[float, collections.Counter[str]]] = {}
    for name, idioms in rows:
        unwatched, _stats = _loop_calls(idioms, steps, None)
        cells, listed = [], []
        for defer in (False, True):
            watched, stats = _loop_calls(idioms, steps, defer)
            extra, ours = watched - unwatched, _ours(stats, by)
            if not idioms:
                base[defer] = (extra, ours)
            cells.append(f"{extra:>10.0f} {extra - base[defer][0]:>6.0f}")
            if top and idioms and not defer:
                listed = (ours - base[defer][1]).most_common(top)
        what = "the benchmarks' step" if not idioms else "every idiom above" if name == "all" else IDIOMS[name]
        print(f"{name:<11} {' '.join(cells)}  {what}")
        for key, count in listed:
            print(f"    {count / steps:7.1f}  {key}")
    print(f"deep_mlp (66 parameters), mean over {steps} iterations after {SETTLE}; immediate/deferred: extra calls an "
          "iteration (watched less unwatched, the same loop); adds: less the minimal loop's")


def _module_calls(bench: object) -> int:
    calls = 0

    def count(*_args: object) -> None:
        nonlocal calls
        calls += 1

    handle = register_module_forward_pre_hook(count)
    try:
        bench.train_step()  # type: ignore[attr-defined]
    finally:
        handle.remove()
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(LAUNCH_BOUND), choices=list(LAUNCH_BOUND))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--top", type=int, default=0, help="list the N functions (or modules) of ours called most")
    parser.add_argument("--by", choices=("function", "file"), default="function")
    parser.add_argument("--defer", action="store_true",
                        help="count the deferred mode (defer=True: probes read once a step, CUDA's default)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="pass NAME=VALUE to watch() (VALUE a Python literal, e.g. replay=False); repeatable")
    parser.add_argument("--idioms", action="store_true",
                        help="only the calls each idiom of a realistic loop adds (clipping, .item(), ...), both modes")
    options = parser.parse_args()
    if options.steps < 1:
        parser.error(f"--steps must be at least 1, not {options.steps}")
    if options.top < 0:
        parser.error(f"--top must be 0 or more, not {options.top}")
    try:
        watch_options = common.watch_options(options.option)
    except ValueError as error:
        parser.error(str(error))
    import nan_magic

    torch.set_num_threads(1)
    if options.idioms:
        print("Python calls the default watch adds to an iteration of a realistic loop, per idiom (cProfile "
              "primitive calls); fp32, CPU, one thread")
        _idioms_table(options.steps, options.top, options.by)
        return
    print("Python calls the default watch adds to a healthy training step (cProfile primitive calls, "
          f"mean over {options.steps} steps after {SETTLE}); fp32, CPU, one thread; "
          f"{'deferred mode (defer=True)' if options.defer else 'immediate mode (the CPU default)'}"
          + "".join(f", {key}={value!r}" for key, value in watch_options.items()))
    if options.models:
        print(f"{'model':<10} {'calls':>6} {'extra/step':>11} {'ours/step':>10} {'extra/call':>11} {'floor/step':>11}")
    for name in options.models:
        bench = build_launch_bound(name)
        module_calls = _module_calls(bench)
        for _ in range(5):
            bench.train_step()
        unwatched = _profiled(bench.train_step, options.steps)
        with nan_magic.watch(bench.model, bench.optimizer, defer=options.defer, **watch_options):
            for _ in range(SETTLE):
                bench.train_step()
            watched = _profiled(bench.train_step, options.steps)
        extra = (watched.prim_calls - unwatched.prim_calls) / options.steps  # type: ignore[attr-defined]
        with baselines.boundary_floor(bench.model):
            for _ in range(5):
                bench.train_step()
            floor = (_profiled(bench.train_step, options.steps).prim_calls  # type: ignore[attr-defined]
                     - unwatched.prim_calls) / options.steps  # type: ignore[attr-defined]
        ours = _ours(watched, options.by)
        print(f"{name:<10} {module_calls:>6} {extra:>11.0f} {sum(ours.values()) / options.steps:>10.0f} "
              f"{extra / module_calls:>11.1f} {floor:>11.0f}")
        for key, count in ours.most_common(options.top):
            print(f"    {count / options.steps:7.1f}  {key}")
    if options.models:
        print("extra/step: every call (builtins and torch's Python included); ours/step: nan_magic's functions; "
              "extra/call: extra/step over the module calls of one step; floor/step: extra/step of the boundary "
              "floor (baselines.boundary_floor)")
    print(f"loss-code recorder: {_loss_code_cost(options.steps, options.defer):.1f} calls per op of loss code "
          f"(a step with {LOSS_OPS} more elementwise ops between the model's return and backward(), less one without)")
    clipping = round(_clipping_cost(options.steps, options.defer))
    print(f"update region: {clipping} calls a step for a clip_grad_norm_ between "
          "backward() and step() (deep_mlp, 66 parameters: a step with it, less one without)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
