"""Source pointers and tracebacks that end in the user's code.

The watch raises from inside a hook, several frames below the user's code
(torch's ``Module._call_impl``, then our hook). ``%debug`` and
``pdb.post_mortem`` open the *last* frame of the traceback, so we cut the
traceback after the last frame that belongs to the user: that is the line
that called the producing module (or ``loss.backward()``, or ``opt.step()``),
with its locals.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
from collections.abc import Iterator
from inspect import CO_NEWLOCALS
from types import CodeType, FrameType, TracebackType
from typing import Any, cast

import torch

from nan_magic.errors.line_state import one_call
from nan_magic.locations import function_name, name_location
from nan_magic.records import SourcePointer

__all__ = [
    "CODES_KEPT",
    "cut_at_placed",
    "cut_where_passed_through",
    "end_at_producer",
    "frames_of",
    "is_library_code",
    "is_library_file",
    "place_at_user",
    "pointer",
    "pointer_at",
    "running_frame_at",
    "short_traceback",
    "user_frames_of",
    "user_line",
    "user_stacklevel",
]

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(module_file)) + os.sep
    for module_file in (torch.__file__, os.path.dirname(__file__))
)
# Frames that are plumbing rather than the user's code: the context manager
# protocol, decorators, importlib, the IPython kernel that runs the cell,
# pytest and runpy (which run the user's tests and scripts), and the code
# torch.fx generates (a torch.compile graph run by the eager backends, a
# GraphModule): a file the user cannot open; the line that called it is theirs.
_PLUMBING_FILES = (
    "contextlib.py",
    "<eval_with_key>",
    "functools.py",
    "<frozen ",
    f"{os.sep}IPython{os.sep}",
    f"{os.sep}ipykernel{os.sep}",
    # The kernel's process below IPython's cell events (a %nanwatch cell's end): its event loop and its start.
    f"{os.sep}asyncio{os.sep}",
    f"{os.sep}tornado{os.sep}",
    f"{os.sep}traitlets{os.sep}",
    f"{os.sep}ipykernel_launcher.py",
    f"{os.sep}_pytest{os.sep}",
    f"{os.sep}pluggy{os.sep}",
    f"{os.sep}runpy.py",
)


def is_library_file(filename: str) -> bool:
    """True for torch's and nan_magic's own files and Python plumbing."""
    if filename.startswith(_LIBRARY_DIRS) or os.path.abspath(filename).startswith(_LIBRARY_DIRS):
        return True
    return any(marker in filename for marker in _PLUMBING_FILES)


def pointer(frame: FrameType, lineno: int | None = None) -> SourcePointer:
    """A :class:`SourcePointer` for a live frame (``lineno`` defaults to its current line)."""
    return pointer_at(frame.f_code, frame.f_lineno if lineno is None else lineno, frame.f_globals)


def pointer_at(code: CodeType, lineno: int, module_globals: dict[str, Any] | None) -> SourcePointer:
    """A :class:`SourcePointer` for line ``lineno`` of ``code`` (a frame's, or one recorded earlier)."""
    text = linecache.getline(code.co_filename, lineno, module_globals).strip() or None
    return SourcePointer(code.co_filename, lineno, code.co_name, text)


def user_line(frame: FrameType | None) -> tuple[CodeType, int, dict[str, Any]] | None:
    """``(code, line, globals)`` of the user's frame at or above ``frame`` as it is now, for :func:`pointer_at` later.

    Cheaper than a :class:`SourcePointer` (no line text read): a record kept in case it is reported.
    """
    while frame is not None and is_library_code(frame.f_code):
        frame = frame.f_back
    return (frame.f_code, frame.f_lineno, frame.f_globals) if frame is not None else None


def user_call(frame: FrameType | None) -> tuple[tuple[CodeType, int, dict[str, Any]], FrameType, int] | None:
    """:func:`user_line`'s record, the user's frame itself and its ``f_lasti`` now (where it called us)."""
    while frame is not None and is_library_code(frame.f_code):
        frame = frame.f_back
    return ((frame.f_code, frame.f_lineno, frame.f_globals), frame, frame.f_lasti) if frame is not None else None


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the caller that names the user's innermost line.

    A warning of the watch is made several frames below the user's code (a
    hook, torch's ``_call_impl``): a fixed stacklevel names a line of torch or
    of nan_magic, which the user cannot act on. 1 is the caller itself.
    """
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and is_library_code(frame.f_code):
        level, frame = level + 1, frame.f_back
    return level


#: The attribute of a warning a filter made an error (``-W error``) that holds the user's frame it was placed at.
_PLACED = "_nan_magic_placed_at"


def place_at_user(error: BaseException) -> None:
    """Note on ``error`` the user's innermost frame running now, the one :func:`user_stacklevel` names.

    A warning of the watch given in a hook (an early warning at ``opt.step()``) that the user's filter made an
    error is raised there, through torch's frames and ours: :func:`cut_at_placed` ends its traceback at that
    frame as the watch is left, where the warning would have been shown.
    """
    frame = sys._getframe(1)
    while frame.f_back is not None and is_library_code(frame.f_code):
        frame = frame.f_back
    setattr(error, _PLACED, frame)


def cut_at_placed(error: BaseException, tb: TracebackType | None) -> bool:
    """End ``tb`` (``error``'s, in place) at the frame :func:`place_at_user` noted; whether it was cut."""
    frame = getattr(error, _PLACED, None)
    entry = tb
    while frame is not None and entry is not None and entry.tb_frame is not frame:
        entry = entry.tb_next
    if entry is None or frame is None:
        return False
    entry.tb_next = None
    return True


def running_frame_at(source: SourcePointer) -> tuple[FrameType, tuple[int, int]] | None:
    """The user's frame running now that ``source`` is a line of, with ``(f_lasti, f_lineno)`` at that line's start.

    For a producer known only by its line (a NaN label read by ``loss = mse_loss(out, y)``, judged as
    ``loss.backward()`` runs, lines later in the same frame): %debug opens there, not at the later line.
    None where no running frame holds that line (its function returned).
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if (start := line_start(code, source)) is not None and not is_library_code(code) and (
                frame.f_lineno >= source.lineno):
            return frame, (start, source.lineno)
        frame = frame.f_back
    return None


def frames_running(frame: FrameType | None) -> Iterator[FrameType]:
    """``frame`` and its callers, then the frames of the exception being handled, innermost first.

    The user's frames that still stand where they stood at an earlier call: the running ones, and where an
    exception of the user's leaves the watch (its exit judges what the deferred check had not yet: timing.py's
    ``pending_at_exit``), the loop's frames it passed through, unwound now but held by its traceback.
    """
    while frame is not None:
        yield frame
        frame = frame.f_back
    tb = sys.exc_info()[2]
    unwound = []
    while tb is not None:
        unwound.append(tb.tb_frame)
        tb = tb.tb_next
    yield from reversed(unwound)


def line_start(code: CodeType, source: SourcePointer | None) -> int | None:
    """The first instruction of ``source``'s line in ``code``; None where ``source`` is no line of that code."""
    if source is None or code.co_filename != source.filename or function_name(code.co_name) != source.function:
        return None
    return min((start for start, _end, line in code.co_lines() if line == source.lineno), default=None)


def running_frame_of(code: CodeType, lasti: int, lineno: int) -> tuple[FrameType, tuple[int, int]] | None:
    """The innermost user frame running ``code`` now, with ``(lasti, lineno)``: where it stood earlier (the line that
    called backward, judged at the deferred check). None where no frame runs it (the function returned) or it is ours
    or torch's (a library called backward: the traceback's last user frame stays)."""
    if is_library_code(code):
        return None
    for frame in frames_running(sys._getframe(1)):
        if frame.f_code is code:  # (at a later instruction, or back at a loop's start: the next micro-batch)
            return frame, (lasti, lineno)
    return None


def leaving_entry(frame: FrameType | None) -> TracebackType | None:
    """A traceback entry at the first user frame from ``frame`` outwards, where it stands now: the with statement
    of a watch left normally (an event judged at its exit has no user's exception whose traceback holds the loop's
    frames). None where only library frames run (a magic's cell: it adopts IPython's traceback itself)."""
    while frame is not None and is_library_code(frame.f_code):
        frame = frame.f_back
    return None if frame is None else TracebackType(None, frame, frame.f_lasti, frame.f_lineno)


# id(code) -> (code, is library code); holding the code keeps its id unique. Cleared past CODES_KEPT entries: code
# compiled again at every step (a model called from ``exec``'d or ``eval``'d code) makes a new code object each time.
_LIBRARY_CODE: dict[int, tuple[CodeType, bool]] = {}
#: How many code objects a cache by id (this one, the replay's walk to the user's frame) holds before it starts again.
CODES_KEPT = 1 << 12


def is_library_code(code: CodeType) -> bool:
    """:func:`is_library_file` for a code object, cached (asked for every frame of a walk up the stack)."""
    entry = _LIBRARY_CODE.get(id(code))
    if entry is None:
        if len(_LIBRARY_CODE) >= CODES_KEPT:
            _LIBRARY_CODE.clear()
        entry = _LIBRARY_CODE[id(code)] = (code, is_library_file(code.co_filename))
    return entry[1]


def _last_user_entries(tb: TracebackType | None) -> tuple[TracebackType | None, TracebackType | None]:
    """The last entry of ``tb`` that is user code, and the entry before it (None for the first)."""
    before = last_user = None
    previous = None
    while tb is not None:
        if not is_library_file(tb.tb_frame.f_code.co_filename):
            before, last_user = previous, tb
        previous = tb
        tb = tb.tb_next
    return before, last_user


#: The calls that led to a producer's frame, outermost first: each the calling frame, its (f_lasti, f_lineno) then.
Calls = tuple[tuple[FrameType, int, int], ...]


def end_at_producer(
    tb: TracebackType | None, producer: FrameType | None, position: tuple[int, int] | None = None,
    calls: Calls = (), holder: BaseException | None = None,
) -> TracebackType | None:
    """Cut ``tb`` after its last user frame, then end it at the producer's frame; return the last entry.

    ``producer`` is the frame that ran the producing op when the traceback
    does not reach it: a replay found the op (localize/replay/module_run.py) after the module
    had returned. Appended, it is where ``%debug`` and ``pdb.post_mortem``
    open, with the producer's locals. ``position`` is ``(f_lasti, f_lineno)``
    when the op ran, where the frame ran on after it (a replay of a whole
    step continues to its end). When the traceback's last user frame is the
    producer's but stands at a later line (ops mode raises where the op's
    value reached a boundary: ``return self.out(r)`` after ``r = h / 0``),
    that entry is replaced by one at ``position``, so that %debug opens on the
    op's line as in the default mode. Calling it again changes nothing.

    ``calls``: how the producer's frame was reached where it had returned (a loss helper, judged as
    ``loss.backward()`` starts). The traceback's last user frame then stands at a later line than the call
    (``loss.backward()``): where it is among ``calls`` its entry moves to the line that called the helper,
    and the helpers between follow, so the traceback reads in call order (the entry the exception holds,
    its first, cannot move: :func:`user_frames_of` reads that one in call order).

    ``holder``: the exception whose traceback ``tb`` is, where it has not been raised on yet (the watch's exit
    in a script's top level, whose frame is the traceback's first entry). That first entry is then replaced
    too, by setting the exception's traceback to the new one, so that ``pdb.pm()`` after ``python -i`` opens
    on the producer's line as ``%debug`` does in a cell.
    """
    before, last = _last_user_entries(tb)
    if last is None:
        return None
    last.tb_next = None
    if producer is None:
        return last
    first = holder if holder is not None and holder.__traceback__ is tb else None

    def moved(frame: FrameType, at: tuple[int, int]) -> TracebackType | None:
        """``last`` again at ``at`` in place of ``last``, or None where it cannot move (the exception holds it)."""
        if before is None and first is None:
            return None
        entry = TracebackType(None, frame, *at)
        if before is None:
            first.__traceback__ = entry  # type: ignore[union-attr]
        else:
            before.tb_next = entry
        return entry

    if last.tb_frame is producer:
        if position is None or (last.tb_lasti, last.tb_lineno) == position:
            return last
        return moved(producer, position) or last
    at = position or (producer.f_lasti, producer.f_lineno)
    if (last.tb_lineno == at[1] or last.tb_frame.f_code.co_flags & CO_NEWLOCALS) and one_call(
            last.tb_frame, producer) and (entry := moved(producer, at)) is not None:
        return entry
    outer = _outer_call(calls, last.tb_frame)
    if outer is not None:
        for frame, at_lasti, at_line in calls[outer:]:
            if frame is not last.tb_frame:
                last.tb_next = last = TracebackType(None, frame, at_lasti, at_line)  # a helper between
            elif (last.tb_lasti, last.tb_lineno) != (at_lasti, at_line):
                last = moved(frame, (at_lasti, at_line)) or last
    lasti, lineno = position if position is not None else (producer.f_lasti, producer.f_lineno)
    last.tb_next = TracebackType(None, producer, lasti, lineno)
    return last.tb_next


#: nan_magic's own package directory: its frames in a traceback are the watch's.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DISPATCH_WAY_IN = (os.path.join(_TORCH_DIR, "_compile.py"), os.path.join(_TORCH_DIR, "_dynamo") + os.sep)


def cut_where_passed_through(tb: TracebackType | None, interrupted: bool = False) -> bool:
    """End a user's own error's traceback (in place) where it entered the watch; whether it was cut.

    A shape mismatch in the loop's code under the watch is raised from the op the watch's dispatch mode passed
    on (the outside recorder, the op tracer): its traceback goes on below the user's line into our frames, and
    torch's that ours called. IPython shows a traceback's last frame even where it is hidden, and ``%debug``
    opens it: unwatched, both stop at the user's line. The frames the error passed through mark themselves
    (``__tracebackhide__``, as IPython and pytest read it); only where every frame of ours below the cut does
    is it cut, so an error of nan_magic itself keeps the frame that raised it.

    ``interrupted``: the error is an interrupt (Ctrl-C, the kernel's stop button). It is never our error, and
    it lands wherever the step was: often several calls deep in a hook, below the hook's entry, which alone is
    marked, and IPython showed those frames (``File .../nan_magic/hot/checks/early.py``) as if nan_magic had
    failed. It is cut at our first frame where IPython would show one of ours: an unmarked one, or the last
    (shown even where marked); where every frame of ours is hidden it is left as it is.
    """
    entries: list[TracebackType] = []
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(_OWN_DIR):
        entries.append(tb)
        tb = tb.tb_next
    # torch calls a dispatch mode through its guard against compiling it (torch/_compile.py, torch/_dynamo):
    # those frames are the watch's way in too (ops=True).
    while entries and entries[-1].tb_frame.f_code.co_filename.startswith(_DISPATCH_WAY_IN):
        tb = entries.pop()
    if not entries or tb is None:
        return False
    previous = entries[-1]
    rest: TracebackType | None = tb
    shown = False  # (an interrupt's: a frame of ours that IPython would show)
    while rest is not None:
        frame = rest.tb_frame
        if frame.f_code.co_filename.startswith(_OWN_DIR):
            if not frame.f_locals.get("__tracebackhide__"):
                if not interrupted:
                    return False
                shown = True
            shown = shown or rest.tb_next is None
        rest = rest.tb_next
    if interrupted and not shown:
        return False
    previous.tb_next = None
    return True


def _outer_call(calls: Calls, frame: FrameType) -> int | None:
    """The index in ``calls`` of the call ``frame`` made (the traceback's last user frame's), or None."""
    for index, (caller, _lasti, _line) in enumerate(calls):
        if caller is frame:
            return index
    return None


def frames_of(tb: TracebackType | None) -> tuple[SourcePointer, ...]:
    """Source pointers of every entry of a traceback, outermost first."""
    pointers = []
    while tb is not None:
        pointers.append(pointer(tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return tuple(pointers)


def user_frames_of(tb: TracebackType | None, calls: Calls = ()) -> tuple[SourcePointer, ...]:
    """Like :func:`frames_of`, keeping only the user's own frames; an entry at a frame that made one of
    ``calls`` (the traceback's first, where :func:`end_at_producer` could not move it) at the line of that call."""
    at_call = {id(frame): line for frame, _lasti, line in calls}
    pointers = []
    while tb is not None:
        if not is_library_file(tb.tb_frame.f_code.co_filename):
            line = at_call.get(id(tb.tb_frame), tb.tb_lineno) if tb.tb_next is not None else tb.tb_lineno
            pointers.append(pointer(tb.tb_frame, line))
        tb = tb.tb_next
    return tuple(pointers)


def short_traceback(headline: list[str], tb: TracebackType | None, producer: SourcePointer | None,
                    calls: Calls = ()) -> list[str]:
    """The short error: the headline (its lines: :func:`headline_lines`), the user's frames, the producer's line.

    What a notebook shows first when a watched cell stops (IPython prints it
    through ``NonFiniteError._render_traceback_``): no frame of torch, of
    nan_magic or of IPython's plumbing, locations named as IPython names
    them (``Cell In[5], line 14``), so the report below stays on the first screen.
    """
    frames = list(user_frames_of(tb, calls))
    at_producer = producer is not None and (producer.filename, producer.lineno) in {
        (frame.filename, frame.lineno) for frame in frames
    }
    if producer is not None and not at_producer:
        frames.append(producer)

    def lines_of(frame: SourcePointer) -> list[str]:
        is_producer = producer is not None and (frame.filename, frame.lineno) == (producer.filename, producer.lineno)
        return _frame_lines(frame, "producer: " if is_producer else "")

    lines = list(headline)
    if len(frames) > _MAX_SHORT_FRAMES:
        # The outermost two (the cell's own lines) and the innermost ones (nearest the producer).
        hidden = len(frames) - _MAX_SHORT_FRAMES + 1
        for frame in frames[:2]:
            lines.extend(lines_of(frame))
        lines.append(f"    ... {hidden} more frames (%tb shows them)")
        frames = frames[2 + hidden:]
    for frame in frames:
        lines.extend(lines_of(frame))
    lines.append("%tb shows the full traceback, %debug opens the debugger")
    return lines


_MAX_SHORT_FRAMES = 5
#: Longest headline kept on one line. A notebook wraps a longer error line
#: wherever it reaches the edge, mid-word ("C|ell In[2]"): so it is broken
#: here, between its clauses, before any frontend has to.
_HEADLINE_WIDTH = 90


def headline_lines(what: str, separator: str, at: str, counts: str) -> list[str]:
    """The headline on one line, or on two where it is long: what and where, then the op, its line and counts.

    The parts are :attr:`Report.message_parts`: a long one breaks after ``... step 3: blocks.0.attn
    (SelfAttention)``, before ``op aten.bmm.default at Cell In[2], line 16 (2 +inf of 2048)``.
    """
    headline = what + separator + at + counts
    if len(headline) <= _HEADLINE_WIDTH or not at:
        return [headline]
    return [what, "  " + at + counts]


def _frame_lines(frame: SourcePointer, prefix: str = "") -> list[str]:
    where = name_location(frame.filename, frame.lineno)
    # A cell's top level (IPython 7's "<cell line: 0>" too: locations.SourcePointer) goes unnamed, as IPython does.
    if frame.function != "<module>":
        where += f", in {frame.function}"
    lines = [prefix + where]
    if frame.line:
        lines.append(f"    {as_typed(frame.line.strip())}")
    return lines


#: IPython's rewriting of a magic, as the cell's code holds it: ``get_ipython().run_cell_magic('time', '', BODY)``.
_MAGIC_CALLS = {"run_cell_magic": "%%", "run_line_magic": "%"}


def as_typed(line: str) -> str:
    """A cell's line as the user typed it: a magic IPython rewrote into a call shown as the magic.

    ``%%nantrace`` over a ``%%time`` cell: its frame's line is the call IPython made of the ``%%time`` cell, its
    whole body escaped into one string (381 characters for a ten-line loop) on the short error's first screen; it
    reads ``%%time``. A line magic keeps its assignment (``t = %timeit -o f()``). Any other line is unchanged.
    """
    if "get_ipython()." not in line:
        return line
    try:
        (statement,) = ast.parse(line).body
    except (SyntaxError, ValueError):
        return line
    call = statement.value if isinstance(statement, (ast.Expr, ast.Assign)) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in _MAGIC_CALLS
            and isinstance(call.func.value, ast.Call) and isinstance(call.func.value.func, ast.Name)
            and call.func.value.func.id == "get_ipython" and len(call.args) >= 2
            and all(isinstance(arg, ast.Constant) and isinstance(arg.value, str) for arg in call.args[:2])):
        return line
    name, argument = (cast(str, cast(ast.Constant, arg).value) for arg in call.args[:2])  # (strings: tested above)
    typed = f"{_MAGIC_CALLS[call.func.attr]}{name} {argument}".rstrip()
    if isinstance(statement, ast.Assign):
        typed = line.encode()[:call.col_offset].decode() + typed  # (ast's offsets count UTF-8 bytes)
    return typed
