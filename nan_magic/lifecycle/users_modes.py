"""The user's dispatch modes entered around the watch: the watch's own ops run beside them, unseen.

A ``TorchDispatchMode`` the user entered around the loop (an op counter, a
``FlopCounterMode``, a debugging mode) sees every op that runs while it is
on the stack, the watch's reads in its hooks too (an ``aminmax`` and an
``item`` per module output, the optimizer check's norms): its counts and its
log were the user's loop plus the watch. Where such modes are on the stack
as the watch is entered, each callback of the watch that torch calls (the
module hooks, the gradient hooks, the backward, optimizer, scaler and
loader callbacks, and the checks as the watch is left) runs with the
dispatch stack emptied and put back after, as torch's own
``_disable_current_modes`` does; the loop's code, the model's forward and
backward included, runs under the user's modes as before. Where none are
(the usual loop), or where torch's infra modes are (``FakeTensorMode``:
they change what a tensor is), nothing is wrapped: the hot path is the same.
Nor in ops mode (``ops=True``): its op tracer is a mode of the watch's that
one callback pushes and another pops, and the user's modes still see the
watch's ops there.

The loop-code recorders (localize/outside/recorder.py, and loop_writes.py's
for the update code) are pushed only onto an empty stack, so they record
nothing under the user's modes anyway; they are kept from pushing inside a
callback, where the stack is empty for a moment and the user's modes would
go back above them. A mode pushed inside a callback and left there (none of
the watch's should be) goes back above the user's, where it was.

A mode the user enters inside the watch (an op counter around a step) comes
after torch holds the callbacks. As it is entered (patches/dispatch_modes.py)
its handler is gated until it is left: an op the watch runs (the innermost
frame that is neither torch's nor our patches' wrappers is nan_magic's) goes on
with the modes below it popped, the others to the user's handler. It costs a
frame walk an op, only while such a mode is on the stack (a 20-layer MLP's
step under a pass-through mode: about 0.6 ms more, on 3.3 ms). Not gated:
``FlopCounterMode`` (none of the watch's reads has a flop formula: it counts
what it would unwatched), torch's checkpointing modes, ours. A replay of the
user's code at an event (a model call run again) runs the user's frames and
reaches their mode; a factory op the loop-code recorder holds the output of
(``torch.rand`` under ``no_grad``) is followed by a ``detach`` that torch's
binding dispatches from the user's line, which the user's mode sees.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from types import CodeType, FrameType, MethodType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.localize.outside.recorder import OutsideRecorder
from nan_magic.patches.dispatch_modes import seeing_modes_entered
from nan_magic.patches.scripting import aside_while_tracing

__all__ = ["beside_users_modes", "keep_apart_from_users_modes", "users_modes_active"]

_depth, _stack_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
_pop, _push = torch._C._pop_torch_dispatch_stack, torch._C._push_on_torch_dispatch_stack

#: The watch's parts, and their callbacks that torch (or the watch's exit) calls.
_CALLBACKS = (
    ("module_hooks", ("pre", "post")),
    ("gradients", ("_on_output_grad", "on_backward_start")),
    ("cycle", ("on_step_pre", "on_step_post", "step_hooks_begin", "step_hooks_ran", "backward_finished")),
    ("optimizers", ("on_grad_accumulated", "on_scale", "before_scaler_step", "after_scaler_step")),
    ("samples", ("on_batch",)),
    ("", ("_leave",)),  # the last step's checks, the report's and the traceback's reads
)


def users_modes_active() -> bool:
    """Whether a mode of the user's is on this thread's stack (not a recorder of ours: an outer watch's, inert
    inside an inference_mode block, around the watch a step replay enters).

    Not where torch's infra modes are (``FakeTensorMode``, proxy and functional modes: a ``_mode_key``): they
    change what a tensor is, and the watch's reads of their tensors must run under them.
    """
    modes = [_stack_at(index) for index in range(_depth())]
    users = [mode for mode in modes if not isinstance(mode, (OutsideRecorder, OpTracer))]
    return bool(users) and all(getattr(mode, "_mode_key", None) is None for mode in users)


def beside(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, run with this thread's dispatch modes popped and pushed back after it."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        depth = _depth()
        if not depth:
            return function(*args, **kwargs)
        modes = [_pop(None) for _ in range(depth)]
        try:
            return function(*args, **kwargs)
        finally:
            pushed = [_pop(None) for _ in range(_depth())]
            for mode in reversed(pushed + modes):
                _push(mode)

    return run


def beside_users_modes(watch: Any, stack: ExitStack) -> None:
    """Run the watch's callbacks beside the user's modes until ``stack`` closes (the watch is left)."""
    for part_name, names in _CALLBACKS:
        part = getattr(watch, part_name) if part_name else watch
        for name in names:
            previous = getattr(part, name)
            if name in vars(part):  # an attribute of its own (the module hooks'): put back
                stack.callback(setattr, part, name, previous)
            else:  # a method: the class's again
                stack.callback(delattr, part, name)
            setattr(part, name, beside(previous))
    update_code = watch.cycle.update_code
    for recorder in (watch.outside, update_code.recorder if update_code is not None else None):
        if recorder is not None:
            recorder.apart = True
            stack.callback(setattr, recorder, "apart", False)


def keep_apart_from_users_modes(watch: Any, stack: ExitStack) -> None:
    """The user's modes do not see the watch's ops until ``stack`` closes: those around it (:func:`beside_users_modes`)
    and those entered inside it (:class:`_Gates`). Not in ops mode (its op tracer is pushed by one callback and
    popped by another). In every mode, the watch steps aside while ``make_fx`` traces (:class:`_Traced`)."""
    traced = _Traced(watch)
    stack.enter_context(seeing_modes_entered(traced.entered))
    stack.enter_context(aside_while_tracing((traced.step_aside, traced.step_back)))
    if watch.config.ops:
        return
    if users_modes_active():
        beside_users_modes(watch, stack)
    else:
        gates = _Gates()
        stack.enter_context(seeing_modes_entered(gates.entered))
        stack.callback(gates.open_all)


# Where a frame's code is: passed over (torch's, or our patches' wrappers, which call what the user called), the
# watch's own (the rest of nan_magic), or the user's. Cached per code object, by id (the code kept: its id stays).
_PASSED, _WATCHS, _USERS = 0, 1, 2
_KINDS: dict[int, tuple[int, CodeType]] = {}
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OURS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # (the package: no import upward)
_PATCHES_DIR = os.path.join(_OURS_DIR, "patches") + os.sep
# Modes not gated: ours (a fix trial's, a replay's); torch's for activation checkpointing (its own machinery, entered
# at each checkpointed call); FlopCounterMode's (none of the watch's reads has a flop formula: its counts are the
# unwatched ones, and a gate would only cost).
_NOT_GATED = ("nan_magic.", "torch.utils.checkpoint", "torch.utils.flop_counter")


def _kind(code: CodeType) -> int:
    entry = _KINDS.get(id(code))
    if entry is None:
        file = code.co_filename
        kind = (_PASSED if file.startswith((_TORCH_DIR, _PATCHES_DIR)) else _WATCHS if file.startswith(_OURS_DIR)
                else _USERS)
        entry = _KINDS[id(code)] = (kind, code)
    return entry[0]


def _watchs_op(frame: FrameType | None) -> bool:
    """Whether the op called from ``frame`` is the watch's: its innermost frame not passed over is nan_magic's."""
    while frame is not None:
        kind = _kind(frame.f_code)
        if kind:
            return kind == _WATCHS
        frame = frame.f_back
    return False


#: The modes of torch's tracing: make_fx's proxy mode, and the fake tensor mode (shape inference, aot_function).
_TRACING = (torch._C._TorchDispatchModeKey.PROXY, torch._C._TorchDispatchModeKey.FAKE)


class _Traced:
    """Tracing inside the watch (``torch.func.linearize``, ``make_fx``, ``aot_function``, a ``FakeTensorMode`` for
    shapes): while its ``ProxyTorchDispatchMode`` or ``FakeTensorMode`` is entered, the watch's hooks ignore the
    calls (``here.mine`` off, as in a replay) and the loop-code recorders step aside (as around ``zero_grad()``);
    the op tracer passes make_fx's ops on unread (localize/ops/tracer.py). ``torch.jit.trace`` (and
    ``trace_module``, ``_get_trace_graph``) the same for its call: :meth:`step_aside` and :meth:`step_back` around
    it (patches/scripting.py), as a ``Recorder`` does.

    The model calls it traces are no training step, and their values cannot be read: a probe's ``float()`` raised
    "trying to get value out of a tracing tensor" in the user's code, each probe would have been a node of the
    user's traced graph, and a recorder's look at a fake tensor's storage warned. Where ``here.mine`` is off
    already (a replay, or the proxy mode entered again inside itself), nothing changes. No cost on a step: only a
    mode entered runs this.
    """

    def __init__(self, watch: Any) -> None:
        self._watch = watch
        self._backs: list[Callable[[], None]] = []  # (step_aside's, innermost last: traces nest)

    def entered(self, mode: TorchDispatchMode) -> Callable[[], None] | None:
        if getattr(mode, "_mode_key", None) not in _TRACING:
            return None
        return self._aside()

    def step_aside(self) -> bool:
        """A ``torch.jit.trace`` begins: the watch steps aside for its call (whether it did: not in a replay)."""
        back = self._aside()
        if back is None:
            return False
        self._backs.append(back)
        return True

    def step_back(self) -> None:
        self._backs.pop()()

    def _aside(self) -> Callable[[], None] | None:
        here = self._watch.here
        if not here.mine:
            return None
        here.mine = False
        update_code = self._watch.cycle.update_code
        recorders = (self._watch.outside, update_code.recorder if update_code is not None else None)
        aside = [recorder for recorder in recorders if recorder is not None and recorder.step_aside()]
        return functools.partial(self._back, aside)

    def _back(self, aside: list[Any]) -> None:
        for recorder in reversed(aside):
            recorder.step_back()
        self._watch.here.mine = True


class _Gates:
    """A watch's gates on the modes the user entered inside it.

    A gate is the mode's ``__torch_dispatch__``, replaced on the instance
    (torch looks it up there): an op the watch runs goes on with the modes
    below popped (the mode's own is off the stack while it runs), the others
    to the user's handler. One frame walk an op, and no dispatch hop more.
    """

    def __init__(self) -> None:
        self._gated: list[tuple[TorchDispatchMode, Callable[..., Any]]] = []

    def entered(self, mode: TorchDispatchMode) -> Callable[[], None] | None:
        """Gate ``mode``, just entered, if it is the user's; what opens it again (before the mode is left)."""
        if (type(mode).__module__.startswith(_NOT_GATED) or not users_modes_active()
                or "__torch_dispatch__" in getattr(mode, "__dict__", {"__torch_dispatch__": None})):
            return None  # (not the user's; under torch's infra modes, which the watch reads under; gated already)
        handler = mode.__torch_dispatch__

        def gate(_mode: TorchDispatchMode, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                 kwargs: dict[str, Any] | None = None) -> Any:
            if not _watchs_op(sys._getframe(1)):
                return handler(func, types, args, kwargs)
            modes = [_pop(None) for _ in range(_depth())]
            try:
                return func(*args, **(kwargs or {}))
            finally:
                for below in reversed(modes):
                    _push(below)

        # (A method bound to the mode, as torch requires of a mode's handler: a plain function reads as a classmethod.)
        bound = vars(mode)["__torch_dispatch__"] = MethodType(gate, mode)
        entry = (mode, bound)
        self._gated.append(entry)
        return functools.partial(self._open, entry)

    def _open(self, entry: tuple[TorchDispatchMode, Callable[..., Any]]) -> None:
        mode, gate = entry
        if vars(mode).get("__torch_dispatch__") is gate:
            del vars(mode)["__torch_dispatch__"]
        if entry in self._gated:
            self._gated.remove(entry)

    def open_all(self) -> None:
        """As the watch ends: a mode the user left open past it (no ``with``) handles every op again."""
        for entry in list(self._gated):
            self._open(entry)
