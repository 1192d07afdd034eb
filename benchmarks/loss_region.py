"""What recording the loss code costs, and what the alternatives to a dispatch mode would (issue 25, hot14b).

Usage::

    python benchmarks/loss_region.py           # the launch-bound models' loss code under each mechanism, ~1 minute
    python benchmarks/loss_region.py --rng     # and the generators' capture at a model call, inside a watched step
    python benchmarks/loss_region.py --push    # and the recorder's push at a region's start, inside a watched step
    python benchmarks/loss_region.py --in-step # and a watched step by segment, the loss region knocked out or replaced

The first part times one loss computation, unwatched, under each mechanism that could see its ops: a no-op
``TorchDispatchMode`` (torch's own cost of a Python mode: each aten op leaves C++ for Python and back), a minimal
recording one (the op, its arguments and output and the user's frame appended: the least a recorder that names an
op at its line must keep), a no-op ``TorchFunctionMode`` (one Python call per torch function, before it decomposes
into aten ops), and the watch's own :class:`OutsideRecorder` (start, the ops, stop: what a step pays). The
configurations run in turn, 40 rounds of 200 calls, and each keeps its fastest round (``time.thread_time``): on a
shared machine a round that another process slowed is dropped rather than averaged in.

``--rng``: the watch takes the generators' state at each top-level model call (StepReplays.begin) so that a replay
draws the same dropout masks. In a training step that costs far more than alone (about 1 us): ``--rng`` times, at
that point of a watched step, a first and a second ``bytearray(5056)`` and ``get_state()``, and ``get_state()``
against ``clone_state()`` on alternate steps: the first allocation there pays, whatever allocates.

``--in-step``: what the loss region costs where it runs, in a training step, not alone. Each launch-bound model's
step is cut into four segments (``zero_grad``, the model call and the loss code, ``backward()``, the optimizer
step), each timed in this thread's CPU time; the columns run in turn, 6 rounds of 60 steps: unwatched, the
default watch, the default watch with its loss region not pushed (the recorder's push skipped for that region
only: what the region costs, all of it), the default watch with a minimal ``TorchFunctionMode`` pushed in its
place (one record a torch function: what recording at the function level would cost at the least), the default
watch with its recorder passing the loss region's ops through unrecorded (the dispatch mode's own cost, without the
records and what is done with them), and the boundary floor (baselines.py: the tiered default's reads alone).
Medians, in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nan_magic.localize.outside.recorder import OutsideRecorder

_push, _pop = torch._C._push_on_torch_dispatch_stack, torch._C._pop_torch_dispatch_stack


class _NoOpDispatch(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func._op(*args, **(kwargs or {}))


class _MinimalRecorder(_NoOpDispatch):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func._op(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs, out, sys._getframe(1)))
        return out


class _NoOpFunction(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _losses() -> dict[str, Callable[[], torch.Tensor]]:
    vocab = 256
    logits = torch.randn(2, 16, vocab, requires_grad=True) * 1.0
    ids = torch.randint(0, vocab, (2, 16))
    scores = torch.randn(16, 10, requires_grad=True) * 1.0
    labels = torch.randint(0, 10, (16,))
    target = torch.randn(16, 10)
    # The same loss at the end of a long function (a notebook cell's or a script's training loop, 300 lines above
    # it): f_lineno scans the code's line table from its start at each read (hot/kept/lines.py).
    source = "def long_loop():\n" + "".join(f"    x{i} = {i}\n" for i in range(300)) + (
        "    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))\n")
    space: dict[str, Any] = {"F": F, "logits": logits, "ids": ids, "vocab": vocab}
    exec(compile(source, "<a long loop>", "exec"), space)
    return {
        "tiny_lm's at line 302 of a function": space["long_loop"],
        # tiny_lm's loss_fn (benchmarks/models.py): next-token cross-entropy of shifted logits
        "tiny_lm": lambda: F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1)),
        # deep_mlp's and small_cnn's
        "cross_entropy": lambda: F.cross_entropy(scores, labels),
        # elementwise loss code: one aten op per torch function
        "mse by hand": lambda: ((scores - target) ** 2).mean(),
    }


def _mechanisms(loss: Callable[[], torch.Tensor]) -> dict[str, Callable[[], Any]]:
    no_op, minimal, function, recorder = _NoOpDispatch(), _MinimalRecorder(), _NoOpFunction(), OutsideRecorder(
        frozenset({"nan", "inf"}))

    def dispatch() -> None:
        _push(no_op)
        loss()
        _pop(None)

    def recording() -> None:
        _push(minimal)
        loss()
        _pop(None)
        minimal.ops.clear()

    def functions() -> None:
        _push_mode(function)
        loss()
        _pop_mode()

    def ours() -> None:
        recorder.start("loss")
        loss()
        recorder.stop()

    def switch() -> None:
        recorder.start("loss")
        recorder.stop()

    return {"unwatched": loss, "no-op dispatch mode": dispatch, "minimal recording dispatch mode": recording,
            "no-op function mode": functions, "OutsideRecorder (start, ops, stop)": ours,
            "OutsideRecorder start+stop, no op": switch}


def _aten_ops(loss: Callable[[], torch.Tensor]) -> list[str]:
    minimal = _MinimalRecorder()
    _push(minimal)
    loss()
    _pop(None)
    return [op[0]._opname for op in minimal.ops]


def mechanisms(rounds: int = 40, calls: int = 200) -> None:
    torch.set_num_threads(1)
    for name, loss in _losses().items():
        runs = _mechanisms(loss)
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(rounds):
            for key, run in runs.items():
                start = time.thread_time_ns()
                for _ in range(calls):
                    run()
                best[key] = min(best[key], (time.thread_time_ns() - start) / calls / 1000)
        print(f"{name}: aten ops {_aten_ops(loss)}")
        for key, us in best.items():
            extra = "" if key == "unwatched" or "no op" in key else f"  +{us - best['unwatched']:.1f}"
            print(f"  {key:40s} {us:7.1f} us{extra}")


def rng(model: str, steps: int = 600) -> None:
    from models import build_launch_bound

    import nan_magic
    import nan_magic.hot.kept.rng as rng_module  # (ModelStates.take calls it at each top-level call)

    taken = rng_module.capture_rng_state
    generator = torch.default_generator
    times: dict[str, list[int]] = {key: [] for key in (
        "bytearray(5056), first", "bytearray(5056), second", "get_state()", "get_state() again",
        "get_state() alone (odd calls)", "clone_state() alone (even calls)")}
    calls = [0]

    def timed() -> Any:
        clock = time.perf_counter_ns
        start = clock()
        bytearray(5056)
        times["bytearray(5056), first"].append(clock() - start)
        start = clock()
        bytearray(5056)
        times["bytearray(5056), second"].append(clock() - start)
        start = clock()
        generator.get_state()
        times["get_state()"].append(clock() - start)
        start = clock()
        generator.get_state()
        times["get_state() again"].append(clock() - start)
        return taken()

    def alternate() -> Any:
        calls[0] += 1
        clock = time.perf_counter_ns
        start = clock()
        if calls[0] % 2:
            generator.get_state()
            times["get_state() alone (odd calls)"].append(clock() - start)
        else:
            generator.clone_state()
            times["clone_state() alone (even calls)"].append(clock() - start)
        return taken()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    for patch in (timed, alternate):
        rng_module.capture_rng_state = patch  # type: ignore[assignment]
        bench = build_launch_bound(model)
        with nan_magic.watch(bench.model, bench.optimizer):
            for _ in range(steps):
                bench.train_step()
    rng_module.capture_rng_state = taken
    for key, values in times.items():
        print(f"  {model:10s} {key:36s} median {statistics.median(values) / 1000:6.1f} us")


def pushes(model: str, steps: int = 500) -> None:
    """The recorder's push at each region's start, in a watched step: the first, then a pop and push again."""
    from models import build_launch_bound

    import nan_magic
    import nan_magic.localize.outside.dispatch_stack as stack_module

    push, pop = stack_module._push, stack_module._pop
    times: dict[str, list[int]] = {"push": [], "pop and push again": []}

    def timed(mode: Any) -> None:
        clock = time.perf_counter_ns
        start = clock()
        push(mode)
        times["push"].append(clock() - start)
        start = clock()
        pop(None)
        push(mode)
        times["pop and push again"].append(clock() - start)

    stack_module._push = timed
    try:
        torch.manual_seed(0)
        torch.set_num_threads(1)
        bench = build_launch_bound(model)
        with nan_magic.watch(bench.model, bench.optimizer):
            for _ in range(steps):
                bench.train_step()
    finally:
        stack_module._push = push
    for key, values in times.items():
        median = statistics.median(values) / 1000
        print(f"  {model:10s} {key:24s} {len(values) / steps:.1f} a step, median {median:5.1f} us")


class _FunctionTape(TorchFunctionMode):
    """The least a function-level loss recorder keeps: the function, its arguments, its output, the caller's place."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        frame = sys._getframe(1)
        self.calls.append((func, args, kwargs, out, frame.f_code, frame.f_lasti))
        return out


def in_step(model: str, rounds: int = 6, steps: int = 60) -> None:
    """A watched step by segment, with the loss region as it is, knocked out, and replaced by a function tape."""
    import contextlib
    import gc

    from baselines import boundary_floor
    from common import pin_malloc
    from models import build_launch_bound

    import nan_magic
    from nan_magic.localize.outside.dispatch_stack import OnTheDispatchStack
    from nan_magic.localize.outside.update_recorder import UpdateRecorder

    original = {name: OnTheDispatchStack.__dict__[name] for name in ("_push", "step_back", "stop", "step_aside")}
    tape = _FunctionTape()
    taped: set[int] = set()  # the recorders whose loss region the tape stands in for now

    def is_loss(recorder: Any) -> bool:
        return type(recorder) is not UpdateRecorder and recorder._region == "loss"

    def skip_loss(recorder: Any) -> None:
        if not is_loss(recorder):
            original["_push"](recorder)

    def tape_loss(recorder: Any) -> None:
        if not is_loss(recorder):
            original["_push"](recorder)
        elif id(recorder) not in taped:
            torch._C._push_on_torch_function_stack(tape)
            taped.add(id(recorder))
            tape.calls.clear()

    def untape(recorder: Any) -> bool:
        if id(recorder) in taped:
            torch._C._pop_torch_function_stack()
            taped.discard(id(recorder))
            return True
        return False

    def tape_stop(recorder: Any) -> None:
        if not untape(recorder):
            original["stop"](recorder)

    def tape_aside(recorder: Any) -> bool:
        return untape(recorder) or original["step_aside"](recorder)

    @contextlib.contextmanager
    def patched(model_: Any, patches: dict[str, Any]) -> Any:
        for name, value in patches.items():
            setattr(OnTheDispatchStack, name, value)
        try:
            with nan_magic.watch(model_):
                yield
        finally:
            for name, value in original.items():
                setattr(OnTheDispatchStack, name, value)

    recorded = OutsideRecorder.__torch_dispatch__

    def passes(recorder: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if recorder._region == "loss":  # the mode on the stack, nothing recorded: torch's trampoline alone
            return func(*args, **(kwargs or {}))
        return recorded(recorder, func, types, args, kwargs)

    @contextlib.contextmanager
    def passing(model_: Any) -> Any:
        setattr(OutsideRecorder, "__torch_dispatch__", passes)  # noqa: B010
        try:
            with nan_magic.watch(model_):
                yield
        finally:
            setattr(OutsideRecorder, "__torch_dispatch__", recorded)  # noqa: B010

    columns: dict[str, Callable[[Any], Any]] = {
        "unwatched": lambda m: contextlib.nullcontext(),
        "default watch": lambda m: nan_magic.watch(m),
        "loss region not pushed": lambda m: patched(m, {"_push": skip_loss, "step_back": skip_loss}),
        "function tape as loss region": lambda m: patched(m, {"_push": tape_loss, "step_back": tape_loss,
                                                               "stop": tape_stop, "step_aside": tape_aside}),
        "loss region passes its ops": passing,
        "boundary floor": boundary_floor,
    }
    pin_malloc()  # (as launch_bound.py: the heap neither trimmed nor mmapped between steps)
    torch.set_num_threads(1)
    bench = build_launch_bound(model)
    clock = time.thread_time

    def run(count: int) -> list[tuple[float, ...]]:
        segments = []
        for _ in range(count):
            t0 = clock()
            bench.optimizer.zero_grad(set_to_none=True)
            t1 = clock()
            loss = bench.loss_fn(bench.model, *bench.batch)
            t2 = clock()
            loss.backward()
            t3 = clock()
            bench.optimizer.step()
            t4 = clock()
            segments.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0))
        return segments

    times: dict[str, list[tuple[float, ...]]] = {key: [] for key in columns}
    for _ in range(rounds):
        for key, column in columns.items():
            gc.collect()
            with column(bench.model):
                run(1)
                times[key] += run(steps)
    print(f"  {model}: median us    zero_grad  call+loss   backward       step      total   over unwatched")
    base = statistics.median(step[4] for step in times["unwatched"])
    for key, steps_ in times.items():
        medians = [statistics.median(step[i] for step in steps_) * 1e6 for i in range(5)]
        print(f"  {key:30s}" + "".join(f"{value:11.0f}" for value in medians) + f"{medians[4] - base * 1e6:+17.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rng", action="store_true", help="and the generators' capture inside a watched step")
    parser.add_argument("--push", action="store_true", help="and the recorder's push inside a watched step")
    parser.add_argument("--in-step", action="store_true",
                        help="and a watched step by segment: the loss region as it is, not pushed, a function tape")
    options = parser.parse_args()
    mechanisms()
    if options.rng:
        for model in ("tiny_lm", "deep_mlp", "small_cnn"):
            rng(model)
    if options.push:
        for model in ("tiny_lm", "small_cnn"):
            pushes(model)
    if options.in_step:
        for model in ("tiny_lm", "deep_mlp", "small_cnn"):
            in_step(model)


if __name__ == "__main__":
    main()
