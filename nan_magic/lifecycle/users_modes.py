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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.localize.outside.recorder import OutsideRecorder

__all__ = ["beside_users_modes", "users_modes_active"]

_depth, _stack_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
_pop, _push = torch._C._pop_torch_dispatch_stack, torch._C._push_on_torch_dispatch_stack

#: The watch's parts, and their callbacks that torch (or the watch's exit) calls.
_CALLBACKS = (
    ("module_hooks", ("pre", "post")),
    ("gradients", ("_on_output_grad", "on_backward_start")),
    ("cycle", ("on_step_pre", "on_step_post", "backward_finished")),
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
