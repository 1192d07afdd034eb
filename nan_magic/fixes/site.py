"""Where a remedy applies: the producer's line, inside the producing module, and nowhere else.

A remedy changes torch *functions* (``torch.log``, ``Tensor.__matmul__``,
``F.linear``), not aten ops: a ``TorchFunctionMode`` sits above autograd, so
the backward of a remedied forward is the remedied function's own derivative
(an upcast matmul's gradient is computed in float32 too). A function call is
the producer's when the innermost user frame that made it is the producer's
line, and the call is inside the producing module (an attention layer's line
runs in every layer; only the one that produced is remedied). The mode runs
only inside a fix trial, on a copy of the model: the fused-path caveat of
function modes (DESIGN.md) does not touch the user's run.

A producer in the loss code (outside every module: ``torch.log(p)`` in a
hand-written loss) is remedied where the trial runs that code again: its
recorded aten ops (fixes/loss.py), which no function mode sees. There the
remedy is given each op at the producer's line under the name of the torch
function it computes (``log`` for ``aten.log.default``), so the same remedies
apply; their backward is again the remedied op's own derivative.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from nan_magic.localize.ops.sources import passed_over, user_frame
from nan_magic.localize.outside.recorded_ops import RecordedOp
from nan_magic.records import SourcePointer

__all__ = ["REPLAY_CALLERS", "InRecordedCode", "Remedy", "Site", "at_producer", "function_name", "in_backward_nodes"]

#: A remedy at one function call: the remedied result, or None to leave the call as it is.
Remedy = Callable[[Any, Sequence[Any], dict[str, Any]], Any]

#: The code a trial calls the model from (step.py's ``_forward``). A call that reaches it with no user frame between
#: ran in library code alone (the producer an ``nn.Linear``, whose line is the one that called the model): it is at
#: the producer's line. Walking on past it found the user's frame that waits on the trial: the model call's line
#: where the event stopped the forward, but the optimizer step's where the deferred check ran (a ``model.half()``
#: overflow's float32 then "found nothing to change" in the deferred watch alone).
REPLAY_CALLERS: set[CodeType] = set()


@dataclass(frozen=True)
class Site:
    """The producer: its module (qualified name, ``""`` the root), its source line, its function."""

    module: str | None
    source: SourcePointer | None
    #: The torch function behind the producing op (``log`` for ``aten.log.default`` or ``LogBackward0``).
    function: str | None
    #: The Python backward the line is in (a custom autograd.Function's node, ``RecipBackward``), or None: remedied as
    #: the trial's backward runs that node, in whichever module used the Function (no module runs in a backward).
    in_backward: str | None = None


def function_name(func: Any) -> str:
    """``log`` for ``torch.log`` and ``Tensor.log``, ``__matmul__`` for ``@`` (a property's getter: its name)."""
    name = getattr(func, "__name__", None)
    if name is None:
        name = getattr(getattr(func, "fget", None), "__name__", "")
    return str(name)


class _AtProducer(TorchFunctionMode):
    """Runs ``remedy`` on the function calls made at ``site``'s line while ``site``'s module runs."""

    def __init__(self, site: Site, remedy: Remedy, inside: Callable[[], bool],
                 entered_from: Callable[[], FrameType | None] = lambda: None) -> None:
        super().__init__()
        self.site = site
        self.remedy = remedy
        self.inside = inside
        #: The user's frame that called the producing module (its outermost call running), where known.
        self.entered_from = entered_from
        #: How many calls the remedy changed: a trial that changed none was not a trial of it.
        self.applied = 0

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.inside():
            return func(*args, **kwargs)
        at_line = self._at_line()
        if at_line:
            result = self.remedy(func, args, kwargs)
            if result is not None:
                self.applied += 1
                return result
        result = func(*args, **kwargs)
        seen = getattr(self.remedy, "seen", None)
        if seen is not None:  # a remedy that reads what the module computed before the line (remedies/stable.py)
            seen(func, args, kwargs, result, at_line)
        return result

    def _at_line(self) -> bool:
        source = self.site.source
        if source is None:
            return True  # no line known: every call of the producing module (its remedy still picks the function)
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and passed_over(frame.f_code):
            if frame.f_code in REPLAY_CALLERS:
                return True  # (the trial's own call of the module, made with no user line between: fixes/step.py)
            frame = frame.f_back
        if frame is None:
            return False
        if frame.f_lineno == source.lineno and frame.f_code.co_filename == source.filename:
            return True
        # No user line between the producing module's call and the op (a library module: a parametrization,
        # nn.MultiheadAttention): the report's line is the one that called the module, which the trial's call is
        # made from only where it runs inside that line (judged as the call returned); a trial from the deferred
        # check calls it from ``opt.step()``'s line.
        return frame is self.entered_from()


_function_modes = _get_current_function_mode_stack


def in_backward_nodes(mode: _AtProducer, node: str, outputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    """``mode`` on while each autograd node named ``node`` (a Python backward: ``RecipBackward``) of ``outputs``'
    graph runs, the producer's line in it; what removes its hooks (and the mode, where a backward raised in it).

    The trial's backward runs inside ``torch.autograd.grad``'s own dispatch, where a function mode is off: hooks of
    the node push it for the node's backward alone. The graph is the trial's, of the copies: the user's has none.
    """
    seen: set[int] = set()
    stack: list[Any] = [output.grad_fn for output in outputs if output.grad_fn is not None]
    handles = []
    pushed: list[bool] = []

    def enter(*_: Any) -> None:
        mode.__enter__()
        pushed.append(True)

    def leave(*_: Any) -> None:
        if pushed:
            pushed.pop()
            mode.__exit__(None, None, None)

    while stack:
        function = stack.pop()
        if function is None or id(function) in seen:
            continue
        seen.add(id(function))
        if type(function).__name__ == node:
            handles += [function.register_prehook(enter), function.register_hook(leave)]
        stack.extend(next_function for next_function, _ in function.next_functions)

    def remove() -> None:
        while pushed:
            pushed.pop()
            # (Where the node's backward raised, autograd's engine has already restored the mode stack it ran under:
            # the push is undone, and exiting again would pop the user's own mode, or an empty stack.)
            modes = _get_current_function_mode_stack()
            if modes and modes[-1] is mode:
                mode.__exit__(None, None, None)
        for handle in handles:
            handle.remove()

    return remove


class _Depth:
    """Whether the producing module is running: global module hooks (no hook on the user's module) count it.

    A call of it that runs where the mode is off gets the mode for its duration: torch runs the backward of
    ``torch.autograd.grad`` inside the mode's own handler, with the mode off, and a checkpointed module runs its
    forward again there (the producer's line too).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.depth = 0
        self.mode: _AtProducer | None = None
        self._pushed: list[int] = []  # the depths at which a call pushed the mode
        #: The user's frame that made the outermost running call of the module (read only at a trial's ops).
        self.entered_from: FrameType | None = None

    def enter(self, module: nn.Module, *_: Any) -> None:
        if module is self.module:
            self.depth += 1
            if self.depth == 1:
                self.entered_from = user_frame(sys._getframe(1))
            mode = self.mode
            if mode is not None and not any(active is mode for active in _function_modes()):
                mode.__enter__()
                self._pushed.append(self.depth)

    def leave(self, module: nn.Module, *_: Any) -> None:
        if module is self.module:
            if self._pushed and self._pushed[-1] == self.depth:
                self._pushed.pop()
                assert self.mode is not None
                self.mode.__exit__(None, None, None)
            self.depth -= 1
            if self.depth == 0:
                self.entered_from = None

    def inside(self) -> bool:
        return self.depth > 0


def at_producer(model: nn.Module, site: Site, remedy: Remedy) -> tuple[_AtProducer, Callable[[], None]]:
    """The mode that applies ``remedy`` at ``site`` in ``model``, and what removes its hooks.

    The root (``""``) is inside for the whole call, and a line in a Python backward wherever it runs; a module the
    model does not have is never inside (the remedy then changes nothing: untried).
    """
    if site.module == "" or site.in_backward is not None:
        return _AtProducer(site, remedy, lambda: True), lambda: None
    try:
        depth = _Depth(model.get_submodule(site.module or ""))
    except AttributeError:
        return _AtProducer(site, remedy, lambda: False), lambda: None
    handles = [register_module_forward_pre_hook(depth.enter),
               register_module_forward_hook(depth.leave, always_call=True)]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    depth.mode = _AtProducer(site, remedy, depth.inside, lambda: depth.entered_from)
    return depth.mode, remove


class _AtenCall:
    """An aten op called as the torch function a remedy knows it by (``log`` for ``aten.log.default``)."""

    def __init__(self, op: Any) -> None:
        self.op = op
        name = getattr(op, "_opname", "")
        self.__name__ = _FUNCTION_OF.get(name, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)


#: aten ops whose torch function has another name.
_FUNCTION_OF = {"_softmax": "softmax", "_log_softmax": "log_softmax", "_linalg_det": "linalg_det"}


class InRecordedCode:
    """Runs ``remedy`` on recorded ops of the code outside the models (the loss code, the data code) at ``site``'s
    line, as a trial runs them again."""

    def __init__(self, site: Site, remedy: Remedy) -> None:
        self.site = site
        self.remedy = remedy
        #: How many ops the remedy changed (as :class:`_AtProducer`'s).
        self.applied = 0

    def run(self, op: RecordedOp, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = _AtenCall(op.func)
        source = self.site.source
        at_line = source is None or (op.code is not None and op.lineno == source.lineno
                                     and op.code.co_filename == source.filename)
        if at_line:
            result = self.remedy(call, args, kwargs)
            if result is not None:
                self.applied += 1
                return result
        result = op.func(*args, **kwargs)
        seen = getattr(self.remedy, "seen", None)
        if seen is not None:  # (remedies/stable.py: a softmax the loss code computed before the line)
            seen(call, args, kwargs, result, at_line)
        return result
