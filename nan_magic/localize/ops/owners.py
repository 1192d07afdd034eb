"""Which watched module's code ran a forward op: a user's forward hook's module, or a child's run without a call.

The watch's module stack (its global hooks) names the module whose call is running. Two kinds of code run outside
what that stack says: a forward hook of the user's, run by torch after the watch's global hook took its module off
the stack, and a child's method its parent called without a module call (``self.act.forward(h)``). The frames of
the op say whose code it is (PRODUCT.md's module). Read at an event, and by NodeSources (sources.py) for a node a
hook made; never per op.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from types import CodeType, FrameType
from typing import Any

import torch
from torch.utils.hooks import BackwardHook

__all__ = ["CALL_IMPL", "backward_hook_module", "called_directly", "forward_hook_module", "hook_owner",
           "root_hook_module"]


#: torch's module call, which calls a module's forward and its hooks.
CALL_IMPL = torch.nn.Module._call_impl.__code__
#: Where torch's ``BackwardHook`` runs a module's full backward hooks (:func:`backward_hook_module`).
_HOOKS_FILE = torch.utils.hooks.BackwardHook.setup_output_hook.__code__.co_filename


def hook_owner(user: FrameType | None, running: str | None,
               named: Callable[[int], str | None] | None = None) -> str | None:
    """The module whose forward hook ran a forward op, where ``user`` (the op's frame) is that hook; else ``running``.

    A forward hook of the user's (``register_forward_hook``: a normalisation of the output) runs in the module's
    call, after torch's global hooks: the watch has taken that module off its stack by then, and ``running`` is its
    parent (:func:`forward_hook_module`; ``named``: a watched module's name by its id, for a root's own hook, where
    nothing runs). Any other op is ``running``'s, or a descendant's whose code ran it without a module call
    (:func:`called_directly`). Called at an event only.
    """
    hooked = forward_hook_module(user, running, named)
    return hooked if hooked is not None else called_directly(sys._getframe(1), running)


def forward_hook_module(user: FrameType | None, running: str | None,
                        named: Callable[[int], str | None] | None = None) -> str | None:
    """The module whose forward hook ``user`` (a frame) is, where it is one; else None.

    The hooked module is the ``self`` of the ``_call_impl`` frame that called the hook, named below the parent's
    own ``_call_impl`` frame's module, ``running``. Where no watched module runs (``running`` None), the hook is a
    top-level call's own (a calibration the user hooked on the model itself): the watch took the root off its stack
    before torch ran it, and ``named`` (a watched module's name by its id) names the hooked module. Reads frames:
    called at an event, and by NodeSources for a node made by code that torch's module call ran and is not a
    ``forward``.
    """
    caller = _hook_caller(user)
    if caller is None or (running is None and named is None):
        return None
    hooked = caller.f_locals.get("self")
    if not isinstance(hooked, torch.nn.Module) or all(_code_of(hook) is not user.f_code  # type: ignore[union-attr]
                                                      for hook in hooked._forward_hooks.values()):
        # A pre-hook (its module is on the stack already), or the module's own forward.
        return None
    if running is None:
        assert named is not None
        return named(id(hooked))
    frame = caller.f_back
    while frame is not None and frame.f_code is not CALL_IMPL:
        frame = frame.f_back
    parent = frame.f_locals.get("self") if frame is not None else None
    if not isinstance(parent, torch.nn.Module):
        return running  # a root's own hook
    for name, module in parent.named_modules():
        if module is hooked and name:
            return f"{running}.{name}" if running else name
    return running


def root_hook_module(code: CodeType, frame: FrameType | None, roots: Iterable[torch.nn.Module],
                     named: Callable[[int], str | None]) -> str | None:
    """The watched root whose own forward hook ``code`` is, where the loop's recorded code ran it; else None.

    The tiered watch records the code between a top-level call's return and ``backward()`` (outside/recorder.py) from
    the watch's global post-hook on: a forward hook the user registered on the root runs after it, and its ops are
    recorded with the loss code's, though the root's call ran them. ``frame`` is the recorded op's frame where it is
    still held: a hook's was called by torch's module call (the same function called by the loop is the loop's).
    Without it, the code alone is matched against the roots' forward hooks. Called at an event only.
    """
    if frame is not None:
        caller = _hook_caller(frame)
        hooked = caller.f_locals.get("self") if caller is not None else None
        return named(id(hooked)) if isinstance(hooked, torch.nn.Module) and any(
            _code_of(hook) is code for hook in hooked._forward_hooks.values()) else None
    for root in roots:
        if any(_code_of(hook) is code for hook in root._forward_hooks.values()):
            return named(id(root))
    return None


def _hook_caller(user: FrameType | None) -> FrameType | None:
    """Torch's ``_call_impl`` frame that called ``user`` (a hook's frame), else None."""
    caller = user.f_back if user is not None else None
    if caller is not None and caller.f_code.co_filename == CALL_IMPL.co_filename and caller.f_code is not CALL_IMPL:
        caller = caller.f_back  # (torch's ``inner`` closure in ``_call_impl``, which calls the hooks)
    return caller if caller is not None and caller.f_code is CALL_IMPL else None


def called_directly(frame: FrameType | None, running: str | None) -> str | None:
    """The watched submodule whose own method ran the current op without a module call, else ``running``.

    ``self.act.forward(h)`` (or ``self.act.step(h)``) runs ``act``'s code with no ``_call_impl`` and no module
    hook: the watch's stack still says the caller (``running``). The op's frames say otherwise: the innermost
    frame below the running module's ``_call_impl`` whose first argument ``self`` is another module, one of the
    running module's descendants, is the module whose own code ran the op (PRODUCT.md), a library module's
    (``self.lin.forward(x)``: ``Linear.forward``'s frame) as well as the user's. ``super().forward(x)`` and a
    helper method keep the running module (their ``self`` is it). Reads frames only: called when an op made a
    non-finite value (an origin), never per op.
    """
    if running is None:
        return running
    own: torch.nn.Module | None = None
    while frame is not None and frame.f_code is not CALL_IMPL:
        code = frame.f_code
        if own is None and code.co_argcount and code.co_varnames[0] == "self":
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, torch.nn.Module):
                own = candidate
        frame = frame.f_back
    parent = frame.f_locals.get("self") if frame is not None else None
    if own is None or own is parent or not isinstance(parent, torch.nn.Module):
        return running
    for name, module in parent.named_modules(remove_duplicate=False):
        if module is own and name:
            return f"{running}.{name}" if running else name
    return running


def backward_hook_module(user: FrameType | None) -> torch.nn.Module | None:
    """The module whose full backward hook or pre-hook ``user`` (a Python backward's frame) is, else None.

    torch runs a module's ``register_full_backward_hook`` and ``register_full_backward_pre_hook`` from closures of
    the ``BackwardHook`` it made in that module's call (torch/utils/hooks.py), which holds the module: the hook's ops
    are the hooked module's, as a forward hook's are (:func:`forward_hook_module`), whoever defined the hook. The
    node its ops run in was made after the watch took that module off its stack (its parent's, by the stack).
    """
    caller = user.f_back if user is not None else None
    if caller is None or caller.f_code.co_filename != _HOOKS_FILE:
        return None
    hook = caller.f_locals.get("self")
    return hook.module if isinstance(hook, BackwardHook) and isinstance(hook.module, torch.nn.Module) else None


def _code_of(hook: Any) -> CodeType | None:
    """A hook's code: a function's, a bound method's or a ``functools.partial``'s."""
    hook = getattr(hook, "func", hook)
    return getattr(getattr(hook, "__func__", hook), "__code__", None)
