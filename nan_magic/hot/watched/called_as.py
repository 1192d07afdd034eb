"""A model kept in a container, named as the user's call wrote it: ``parts['decoder']``, ``models[1]``.

A model held in a dict or a list has no name of its own, and a name that happens to be bound to it (the loop
variable ``part`` an earlier cell's ``for name, part in parts.items()`` left behind) is not how the code means it. The
call that makes it join the watch says: ``parts['decoder'](code)``. The user's frame that is calling it (the first
outside torch and nan_magic) is running that call; its source span (``co_positions`` of the instruction) is parsed,
and where the callee is a name subscripted by constants (``parts['decoder']``, ``nets[0][1]``) that resolves, through
plain dicts, lists and tuples only (no user ``__getitem__`` runs), to the very module, that text is the label. Any
other callee (``model``, ``self.critic``, ``nets[i]``) says nothing here, nor does any call before Python 3.11 (no
``co_positions``). Only at a join: no cost a step.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import sys
from types import FrameType
from typing import Any

from nan_magic.errors.frames import is_library_code

__all__ = ["called_as", "let_go", "user_frame"]

#: Frames walked out from the hook to the user's (torch's call machinery, nan_magic's hook).
_WALKED = 16

#: Whether a function frame's ``f_locals`` is a snapshot the frame keeps (PEP 667 made it a view in 3.13).
_SNAPSHOTS = sys.version_info < (3, 13)

#: ``sys.getrefcount`` of a frame's snapshot that only the frame and the function reading it hold: the frame, that
#: function's ``local`` and the count's own argument. More: the user's code (``env = locals()``), or a debugger, holds
#: it too. Counted in a statement of its own where it is read, never in a function it is passed to: once
#: torch.compile has run in the process, dynamo's frame evaluator stays installed, and under it every Python call
#: holds its arguments once more for as long as it runs (a count one call down read one too many). Nor inside another
#: call's arguments, where the value stack holds it too.
_HELD_BY_FRAME_AND_US = 3


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame out from ``frame`` that is neither torch's nor nan_magic's, or None."""
    for _ in range(_WALKED):
        if frame is None or not is_library_code(frame.f_code):
            return frame
        frame = frame.f_back
    return None


def called_as(module: Any, frame: FrameType | None = None, local: dict[str, Any] | None = None) -> str | None:
    """``parts['decoder']`` where the user's frame is calling ``module`` as a constant subscript of a container the
    frame can see; None otherwise. ``frame``: the user's frame (None: the first out from this function's caller);
    ``local``: its ``f_locals`` where the caller has read them (and lets go of them: :func:`let_go`)."""
    if frame is None:
        frame = user_frame(sys._getframe(1))
        if frame is None:
            return None
    callee = _callee(frame)
    if callee is None:
        return None
    if local is not None:
        return ast.unparse(callee) if _resolved(callee, (local, frame.f_globals)) is module else None
    local = frame.f_locals
    found = _resolved(callee, (local, frame.f_globals))
    held = sys.getrefcount(local)
    let_go(frame, local, held)
    return ast.unparse(callee) if found is module else None


def let_go(frame: FrameType, local: dict[str, Any], held: int) -> None:
    """Empty the ``f_locals`` snapshot of a function frame read at a join, unless someone else holds it: ``held`` is
    ``sys.getrefcount(local)`` as the function that read it counted it (see ``_HELD_BY_FRAME_AND_US``).

    Before Python 3.13 a function's ``f_locals`` is a snapshot the frame keeps: it would hold what the loop's
    locals were at the join (the generator's output, its graph, when D joins) for as long as the loop runs.
    Emptied, it holds nothing; CPython fills it afresh wherever it is read (``locals()``, a tracer's call).
    It is the very dict ``locals()`` gave the user's code: one they kept (``env = locals()``) is theirs, and
    stays as it is (it holds those values anyway, for as long as they keep it).
    """
    if (_SNAPSHOTS and frame.f_code.co_flags & inspect.CO_OPTIMIZED and local is not frame.f_globals
            and held <= _HELD_BY_FRAME_AND_US):
        local.clear()


def _callee(frame: FrameType) -> ast.expr | None:
    """The callee of the call the frame's current instruction makes, where it is a subscript by constants."""
    if sys.version_info < (3, 11):  # (no co_positions: the class or a bound name labels it, as before)
        return None
    positions = list(frame.f_code.co_positions())
    index = frame.f_lasti // 2
    if not 0 <= index < len(positions):
        return None
    first, last, start, end = positions[index]
    if first is None or last is None or start is None or end is None:
        return None
    lines = linecache.getlines(frame.f_code.co_filename, frame.f_globals)[first - 1:last]
    if not lines:
        return None
    encoded = [line.encode() for line in lines]  # (the offsets count UTF-8 bytes)
    encoded[-1] = encoded[-1][:end]
    encoded[0] = encoded[0][start:]
    try:
        call = ast.parse(b"".join(encoded).decode(), mode="eval").body
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Subscript):
        return None
    return call.func if _constant_subscripts(call.func) else None


def _constant_subscripts(node: ast.expr) -> bool:
    while isinstance(node, ast.Subscript):
        if not isinstance(node.slice, ast.Constant):
            return False
        node = node.value
    return isinstance(node, ast.Name)


def _resolved(node: ast.expr, scopes: tuple[dict[str, Any], ...]) -> Any:
    if isinstance(node, ast.Name):
        return next((scope[node.id] for scope in scopes if node.id in scope), None)
    assert isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
    container = _resolved(node.value, scopes)
    if type(container) not in (dict, list, tuple):  # (a user's __getitem__ never runs)
        return None
    try:
        return container[node.slice.value]
    except (KeyError, IndexError, TypeError):
        return None
