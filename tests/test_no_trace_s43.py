"""The watch never leaves a trace on the user's program (PRODUCT.md), however the watch ends (trace-s43).

The checker (no_trace_state.py) dumps the process's state and the user's objects' state; each case runs a training
loop with a model that draws random numbers (dropout), an Adam optimizer, a scheduler and a GradScaler, once
unwatched and once under ``watch()`` in every mode, and compares: (a) a healthy loop, (b) a NaN the watch reports and
the loop goes on (``on_detect="warn"``) or that it raises, (c) the user's own exception, (d) a KeyboardInterrupt,
(e) a watch nested in another and one entered again after it. The twins must end bit-identical, RNGs included; the
process's state after the watch must be what it was before it (the dynamo stance a user set, their ``locals()``).
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy
import pytest
import torch
from no_trace_state import differences, global_state, object_state
from torch import nn

import nan_magic

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}
NAN_STEP = 2


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # a batch below 0 makes NaN


class Parts:
    """A user's training setup, the same for a seed."""

    def __init__(self) -> None:
        random.seed(0)
        numpy.random.seed(0)
        torch.manual_seed(0)
        self.model = nn.Sequential(Log(), nn.Linear(6, 6), nn.Dropout(0.3), nn.Tanh(), nn.Linear(6, 2))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        self.stance_set: Any = None
        self.batch: Any = None  # the loop's last batch, as the user's code left it
        self.tensors = [*self.model.parameters(), *self.model.buffers()]

    def state(self, identities: bool = True) -> dict[str, Any]:
        return object_state(self.model, self.optimizer, self.scheduler, self.scaler, identities)


def train(parts: Parts, watch: Callable[[], Any], case: str, steps: int = 4) -> tuple[dict[str, Any], list[Any]]:
    """The user's loop under ``watch()``: its own ``locals()`` snapshot and the gradients its last step saw."""
    model, optimizer, scheduler, scaler = parts.model, parts.optimizer, parts.scheduler, parts.scaler
    env = locals()  # the user's own: kept as they took it
    seen: list[Any] = []
    with watch():
        for step in range(steps):
            shift = -30.0 if case.startswith("nan") and step == NAN_STEP else 0.5
            batch = torch.rand(4, 6) + shift
            if case == "raise" and step == NAN_STEP:
                raise ValueError("the user's own error")
            if case == "interrupt" and step == NAN_STEP:
                raise KeyboardInterrupt
            if case == "stance" and step == 1:
                torch.compiler.set_stance("eager_on_recompile")  # the user's, inside the watch: it holds
                parts.stance_set = torch._dynamo.eval_frame._stance
            hidden = model[:2](batch)
            if case == "interrupt-backward" and step == NAN_STEP:
                hidden.register_hook(_interrupt)  # (Ctrl-C landing in the backward)
            if case == "interrupt-forward" and step == NAN_STEP:
                hidden = _interrupt(hidden)
            loss = model[2:](hidden).pow(2).mean() + 0.001 * random.random() + 0.001 * float(numpy.random.rand())
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            seen = [p.grad for p in model.parameters()]
            parts.batch = batch
    return env, seen


def _interrupt(value: Any) -> Any:
    raise KeyboardInterrupt


def _run(case: str, watch: Callable[[Parts], Callable[[], Any]] | None) -> tuple[Parts, dict[str, Any], Any, Any]:
    parts = Parts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outcome: Any = None
        env: Any = None
        try:
            env, seen = train(parts, watch(parts) if watch is not None else contextlib.nullcontext, case)
            outcome = [g is p.grad for g, p in zip(seen, parts.model.parameters())]
            batch = parts.batch
            assert (batch.requires_grad, batch.grad_fn, batch.grad, batch._version) == (False, None, None, 0)
        except (ValueError, KeyboardInterrupt, nan_magic.NonFiniteError) as error:
            outcome = type(error).__name__
    assert all(a is b for a, b in zip(parts.tensors, [*parts.model.parameters(), *parts.model.buffers()]))
    return parts, global_state(), outcome, env


def _watch_of(options: dict[str, Any], on_detect: str = "raise") -> Callable[[Parts], Callable[[], Any]]:
    return lambda parts: lambda: nan_magic.watch(**options, on_detect=on_detect)


def _nested(options: dict[str, Any]) -> Callable[[Parts], Callable[[], Any]]:
    """A watch of the model (default mode) with one in ``options`` nested inside, and one more entered after."""
    @contextlib.contextmanager
    def both(parts: Parts) -> Iterator[None]:
        with nan_magic.watch(parts.model, parts.optimizer):
            with nan_magic.watch(parts.model, parts.optimizer, **options):
                pass
            yield
        with nan_magic.watch(**options):
            pass
    return lambda parts: lambda: both(parts)


CASES: dict[str, Callable[[dict[str, Any]], Callable[[Parts], Callable[[], Any]]]] = {
    "healthy": _watch_of, "nan-warned": lambda options: _watch_of(options, "warn"), "nan-raised": _watch_of,
    "raise": _watch_of, "interrupt": _watch_of, "interrupt-forward": _watch_of, "interrupt-backward": _watch_of,
    "nested": _nested, "stance": _watch_of,
}
#: What the loop ends with, unwatched and watched.
ENDS = {"healthy": [True] * 4, "nan-warned": [True] * 4, "nan-raised": "NonFiniteError", "raise": "ValueError",
        "interrupt": "KeyboardInterrupt", "interrupt-forward": "KeyboardInterrupt",
        "interrupt-backward": "KeyboardInterrupt", "nested": [True] * 4, "stance": [True] * 4}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", list(MODES))
def test_the_watch_leaves_no_trace_on_the_process_or_the_users_objects(mode: str, case: str) -> None:
    twin, twin_globals, twin_end, _ = _run(case, None)  # (first: torch's own first-use changes, Adam.step's)
    if case == "stance":
        torch.compiler.set_stance("default")
        twin_globals["stance"] = torch._dynamo.eval_frame._stance
    before = global_state()
    assert differences(twin_globals, before) == {}
    parts, after, end, env = _run(case, CASES[case](MODES[mode]))
    if case == "stance":
        stance = after.pop("stance")
        assert stance is parts.stance_set  # the very stance the user set, inside the watch and after it
        torch.compiler.set_stance("default")
        before.pop("stance")
    assert differences(before, after) == {}
    assert end == ENDS[case] if case != "nan-raised" else end == "NonFiniteError"
    if case != "nan-raised":  # (the twin has no watch to stop it at the NaN)
        assert twin_end == end
        assert differences(twin.state(identities=False), parts.state(identities=False)) == {}
    assert all(not ids for hooks in parts.state()["module hook ids"].values() for ids in hooks.values())
    if env is not None:  # the user's ``locals()``: never emptied (before 3.13 a read of the frame's f_locals
        # refreshes it to the frame's current locals, as the user's own ``locals()`` call would: not compared)
        assert {"case", "env", "model", "optimizer", "parts", "scaler", "scheduler", "steps", "watch"} <= env.keys()
        assert env["model"] is parts.model and env["env"] is env


@pytest.mark.parametrize("case", ["healthy", "nan-raised", "raise", "interrupt-forward", "interrupt-backward"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_stance_the_user_set_before_the_watch_is_theirs_again_after_it(mode: str, case: str) -> None:
    """The very stance object, whether the watch ended well, reported, or was left by an error or an interrupt."""
    torch.compiler.set_stance("fail_on_recompile")
    theirs = torch._dynamo.eval_frame._stance
    try:
        _, _, end, _ = _run(case, CASES[case](MODES[mode]))
        assert end == ENDS[case]
        assert torch._dynamo.eval_frame._stance is theirs
    finally:
        torch.compiler.set_stance("default")


def _stance() -> Any:
    return torch._dynamo.eval_frame._stance


@pytest.mark.parametrize("mode", ["full", "ops", "ops-defer"])
def test_a_stance_the_user_sets_around_a_compiled_models_call_in_the_watch_is_theirs_after_it(mode: str) -> None:
    """The full watch runs a compiled model eagerly from its first call (module_hooks.py); a stance the user sets
    after that call is theirs, inside and after; one they set in a ``with`` inside gives the watch's back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    compiled = torch.compile(model, backend="eager")
    before = _stance()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with nan_magic.watch(compiled, **MODES[mode]) as w:
                compiled(torch.rand(2, 4)).sum().backward()
                watchs = _stance()
                assert watchs.stance == "force_eager"
                with torch.compiler.set_stance("eager_on_recompile"):
                    assert _stance().stance == "eager_on_recompile"
                    compiled(torch.rand(2, 4)).sum().backward()
                assert _stance() is watchs  # their with statement gave the watch's back
                torch.compiler.set_stance("fail_on_recompile")
                theirs = _stance()
                assert _stance() is theirs
                # The watch's next call of the compiled model needs force_eager again: without it dynamo would
                # compile the watch's hooks in, and the user's fail_on_recompile would raise on healthy code.
                compiled(torch.rand(2, 4)).sum().backward()
                assert _stance().stance == "force_eager"
            assert w.report is None
            assert _stance() is theirs
        finally:
            torch.compiler.set_stance("default")
    assert before.stance == "default"


def test_watches_left_out_of_order_give_back_the_stance_from_before_the_first() -> None:
    """A watch outliving the one it was entered in (``%nanwatch on`` across cells) never leaves a watch's stance."""
    from nan_magic.hot.watched.eager_stance import eager_stance

    torch.compiler.set_stance("eager_on_recompile")
    theirs = _stance()
    try:
        first, second = eager_stance(), eager_stance()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert _stance().stance == "force_eager"  # the second watch is still on
        second.__exit__(None, None, None)
        assert _stance() is theirs
        first, second = eager_stance(), eager_stance()
        first.__enter__()
        torch.compiler.set_stance("default")
        second.__enter__()
        first.__exit__(None, None, None)
        second.__exit__(None, None, None)
        assert _stance().stance == "default"  # the user's call in between: theirs
    finally:
        torch.compiler.set_stance("default")


@pytest.mark.parametrize("mode", ["full", "ops", "ops-defer"])
def test_a_stance_of_a_with_block_around_a_compiled_call_in_the_watch_ends_with_the_block(mode: str) -> None:
    """The user's ``with set_stance(X):`` around a compiled model's call inside the watch, and no later call of
    theirs: X ends with their block, and the stance from before the watch is back after it (the watch set
    ``force_eager`` again inside the block: what that one replaced is the block's X, not the watch's to give back)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    compiled = torch.compile(model, backend="eager")
    torch.compiler.set_stance("eager_on_recompile")
    theirs = _stance()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with nan_magic.watch(compiled, **MODES[mode]):
                compiled(torch.rand(2, 4)).sum().backward()
                with torch.compiler.set_stance("fail_on_recompile"):
                    compiled(torch.rand(2, 4)).sum().backward()
            assert _stance() is theirs
            compiled(torch.rand(3, 5, 4))  # a recompile after the watch: no "Detected recompile" error
        finally:
            torch.compiler.set_stance("default")


@pytest.mark.parametrize("mode", list(MODES))
def test_a_users_locals_snapshot_is_never_emptied_by_naming_a_discovered_model(mode: str) -> None:
    """``env = locals()`` in the training function: the discovering watch reads the frame's names for the model's
    label (root_labels.py), and before Python 3.13 that is the very dict the user holds."""
    def training() -> dict[str, Any]:
        torch.manual_seed(0)
        critic = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        optimizer = torch.optim.SGD(critic.parameters(), lr=0.1)
        env = locals()
        with nan_magic.watch(**MODES[mode]) as w:
            critic(torch.rand(2, 3)).sum().backward()
            optimizer.step()
        assert [label for label, _ in w.targets.roots] == ["critic"]  # (named from this very frame)
        return env

    env = training()
    assert env["critic"] is not None and isinstance(env["optimizer"], torch.optim.SGD) and env["env"] is env


SETUP = """
import torch, random
from torch import nn
torch.manual_seed(0)
class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)
model = nn.Sequential(Log(), nn.Linear(6, 6), nn.Dropout(0.3), nn.Linear(6, 2))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
"""
#: The cell's loop: its step 2 makes NaN, raises the user's error or is interrupted (``{end}``).
LOOP = """
for step in range(4):
    batch = torch.rand(4, 6) + 0.5
    if step == 2:
        {end}
    loss = model(batch).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
ENDINGS = {"healthy": "pass", "nan": "batch = batch - 30", "raise": "raise ValueError('theirs')",
           "interrupt": "raise KeyboardInterrupt"}


def _shell_state(ip: Any) -> dict[str, Any]:
    """What of the shell a magic could leave changed."""
    formatters = ip.display_formatter.formatters
    return {
        "own attributes": sorted(name for name in vars(ip) if not name.startswith("_")
                                 and name not in ("execution_count", "last_execution_result",
                                                  "last_execution_succeeded")),
        "showtraceback": vars(ip).get("showtraceback"),
        "custom exceptions": (ip.custom_exceptions, ip.CustomTB),
        "events": {name: [id(callback) for callback in callbacks] for name, callbacks in ip.events.callbacks.items()},
        "transformers": ([id(t) for t in ip.input_transformers_cleanup], [id(t) for t in ip.input_transformers_post],
                         [id(t) for t in ip.ast_transformers]),
        "formatters": {name: (len(f.type_printers), len(f.deferred_printers)) for name, f in formatters.items()},
        "traceback mode": (ip.InteractiveTB.mode, ip.InteractiveTB.tb_offset),
        "user names": sorted(name for name in ip.user_ns if not name.startswith("_") and name not in (
            "step", "batch", "loss")),
        "hooks": (sys.excepthook, sys.displayhook),
        "process": global_state(),
    }


@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("flags", ["", "--defer", "--full", "--ops", "--ops --defer"])
@pytest.mark.parametrize("magic", ["%%nantrace", "%nanwatch", "%nanwatch on"])
def test_a_watched_cell_leaves_no_trace_on_the_shell_or_the_process(ip: Any, magic: str, flags: str,
                                                                      ending: str) -> None:
    from IPython.utils.capture import capture_output

    with capture_output():
        ip.run_cell(SETUP)
        ip.run_cell(LOOP.format(end="pass"))  # (torch's own first-use changes)
        ip.run_cell(SETUP)
    before = _shell_state(ip)
    cell = LOOP.format(end=ENDINGS[ending])
    with capture_output(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if magic == "%nanwatch on":
            ip.run_cell(f"%nanwatch on {flags}")
            result = ip.run_cell(cell)
            ip.run_cell("%nanwatch off")
        else:
            result = ip.run_cell(f"{magic} {flags}\n{cell}")
    expected = {"healthy": None, "nan": "NonFiniteError", "raise": "ValueError", "interrupt": "KeyboardInterrupt"}
    error = result.error_in_exec
    assert (type(error).__name__ if error is not None else None) == expected[ending]
    after = _shell_state(ip)
    process = after.pop("process")
    assert differences(before.pop("process"), process) == {}
    assert {key: (value, after[key]) for key, value in before.items() if after[key] != value} == {}


def _trained_into_an_event(options: dict[str, Any], on_detect: str) -> tuple[list[Any], Any, Any]:
    """A training function whose step 2 makes NaN; weak references to its model, outputs and watch."""
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(Log(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    outputs: list[Any] = []
    watch = nan_magic.watch(model, optimizer, **options, on_detect=on_detect)
    with warnings.catch_warnings(), contextlib.suppress(nan_magic.NonFiniteError):
        warnings.simplefilter("ignore")
        with watch:
            for step in range(4):
                out = model(torch.rand(4, 6) + (-30.0 if step == NAN_STEP else 0.5))
                outputs.append(weakref.ref(out))
                optimizer.zero_grad()
                out.pow(2).mean().backward()
                optimizer.step()
    assert watch.report is not None and watch.report.step == NAN_STEP
    return outputs, weakref.ref(model), weakref.ref(watch)


@pytest.mark.parametrize("on_detect", ["warn", "raise"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_watch_that_reported_keeps_nothing_alive_once_the_user_lets_go(mode: str, on_detect: str) -> None:
    """After an event the report's frames hold the step's outputs; the gradient hook on each output (held by its
    autograd node, where the collector cannot see) held the watch: model, outputs and watch lived on for good."""
    import gc

    outputs, model, watch = _trained_into_an_event(MODES[mode], on_detect)
    gc.collect()
    assert (model(), watch(), [output() for output in outputs]) == (None, None, [None] * len(outputs))
