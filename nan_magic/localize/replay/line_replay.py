"""%debug at the forward line of a backward producer: the model call replayed to the end of that line.

A backward op's report names the forward line that made its autograd node
(``r = h.abs().sqrt()``, whose gradient is infinite at 0). That line's frame
returned before backward ran, so the traceback ends at ``loss.backward()``. The
step replay (root_calls.rerun) knows the node's number, counted from the
replayed call's start: the call is replayed once more, under the same nested
watch (the same guards, so nothing it writes stays, and the same nodes made in
the same order), with a trace on the frames of that line's function only.
When the run of that line that made the node ends, its frame's locals are
copied into a stand-in (errors/line_state.py), reached from the loop's line
through the replay's frames (sources.replayed_calls). Autograd numbers nodes
per thread in the order it makes them, so the same count from the call's start
names the same node where the replay runs as before; where the line never
makes it (the replay went another way), %debug keeps the frame it had, and the
report says why (:data:`NOT_REACHED`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, Protocol

import torch

from nan_magic.errors.line_state import state_left_by
from nan_magic.hot.reads import transformed_call
from nan_magic.localize.ops.sources import Chain, calls_from_caller, replayed_calls
from nan_magic.records import Note, Phase

if TYPE_CHECKING:  # pragma: no cover - typing only
    from collections.abc import Sequence

    from nan_magic.hot.kept.finding import Finding
    from nan_magic.localize.ops.origins import OpFinding
    from nan_magic.localize.ops.tracer import OpTracer
    from nan_magic.records import Report

__all__ = ["NOT_KEPT", "NOT_REACHED", "ForwardLines", "LineStop", "line_stop_at", "line_stop_for", "nodes_made"]

#: The reason a note gives where the replay to the line did not stop there (a note's pair: render/ words it).
NOT_REACHED = Note("line-node-not-remade").pair
#: ... where no model call of the step that was kept made the node (ops mode).
NO_CALL = Note("line-call-not-kept").pair
#: ... where the call that made the node ran inside a torch.func transform (its arguments gone with the transform).
IN_TRANSFORM = Note("line-call-transformed").pair
#: ... where an ops-mode watch keeps no model call at all (they are kept for the fix trials).
NOT_KEPT = Note("ops-keeps-no-call").pair


def nodes_made() -> int:
    """How many autograd nodes this thread has made (the next node's ``_sequence_nr()``)."""
    return int(torch._C._autograd._get_sequence_nr())


class LineStop:
    """Where to stop a replay of a model call: the run of ``code``'s line ``lineno`` that makes the call's node
    number ``offset`` (counted from the call's start); then the stand-in frame, its position and its calls."""

    def __init__(self, code: CodeType, lineno: int, offset: int) -> None:
        self.code, self.lineno, self.offset = code, lineno, offset
        self.frame: FrameType | None = None
        self.position: tuple[int, int] | None = None
        self.calls: Chain = ()
        self._node = 0

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Trace the frames of ``code`` while the replayed call runs (armed right before it)."""
        self._node = nodes_made() + self.offset
        previous = sys.gettrace()  # a debugger's or a coverage tool's: called on, for every frame

        def calls(frame: FrameType, event: Any, arg: Any) -> Any:  # (event: a str, as sys.settrace types it)
            local = previous(frame, event, arg) if previous is not None else None
            if frame.f_code is self.code and self.frame is None:
                return _LineTrace(self, local)
            return local

        sys.settrace(calls)
        try:
            yield
        finally:
            sys.settrace(previous)

    def line_ended(self, frame: FrameType, made_before: int) -> None:
        """The line ran in ``frame`` from node number ``made_before`` on: stop there if it made the node."""
        if not made_before <= self._node < nodes_made():
            return
        stand_in = state_left_by(frame, self.lineno)
        if stand_in is None:
            return
        self.frame, self.position = stand_in, (stand_in.f_lasti, self.lineno)
        self.calls = calls_from_caller(replayed_calls(frame))


class _LineTrace:
    """The local trace of one frame of the line's function (and of the trace it had, called on)."""

    def __init__(self, stop: LineStop, local: Any) -> None:
        self.stop, self.local = stop, local
        self.started: int | None = None  # node count when the line began, while it runs

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        stop = self.stop
        if self.started is not None:  # any event after the line began ends it: the next line, a return
            stop.line_ended(frame, self.started)
            self.started = None
        if event == "line" and frame.f_lineno == stop.lineno and stop.frame is None:
            self.started = nodes_made()
        if self.local is not None:
            self.local = self.local(frame, event, arg)
        return self if stop.frame is None else self.local


def line_stop_for(tracer: OpTracer | None, report: Report | None, start: int) -> LineStop | None:
    """The stop at the forward line of a replay's backward producer (``start``: nodes made before the call).

    None where the report is not a backward op's (autograd's own formula) named by its forward line, or the trace
    did not note the line's code: then %debug opens where it did.
    """
    if tracer is None or report is None or report.phase != Phase.BACKWARD or report.source is None:
        return None
    for origin in tracer.started:
        if origin.forward_source == report.source and origin.autograd_node == report.autograd_node:
            stop = line_stop_at(tracer, origin, start)
            if stop is not None:
                return stop
    return None


def line_stop_at(tracer: OpTracer, origin: OpFinding, start: int) -> LineStop | None:
    """The stop at the forward line that made the node of backward op ``origin`` (autograd's own formula), or None."""
    number, source = origin.node_number, origin.forward_source
    if origin.phase != Phase.BACKWARD or origin.backward_code or number is None or source is None or number < start:
        return None
    code = tracer.node_sources.code_of(number)
    return LineStop(code, source.lineno, number - start) if code is not None else None


class _Begun(Protocol):
    """A kept top-level call (root_calls.RootCall): the autograd nodes made before it began, where counted."""

    @property
    def nodes_before(self) -> int | None: ...

    @property
    def args(self) -> tuple[Any, ...]: ...

    @property
    def kwargs(self) -> dict[str, Any]: ...


class KeptCalls(Protocol):
    """The step's top-level calls an ops-mode watch keeps (replay/step.StepReplays): what :class:`ForwardLines` uses."""

    @property
    def calls(self) -> Sequence[_Begun]: ...

    def run_to_line(self, root: Any, stop: LineStop) -> None: ...


class ForwardLines:
    """Ops mode: %debug at the forward line of a backward op that the live tracer named in the user's backward.

    The node was made in the user's forward: the step's kept call begun last before it is replayed (as a step
    replay runs it) to the run of that line that makes the node again, counted from the call's start
    (``RootCall.nodes_before``). Once per watch: the first real event is the one %debug opens.
    """

    def __init__(self, kept: KeptCalls | None, step: Callable[[], int]) -> None:
        self.kept, self.step = kept, step  # (kept None: a watch that keeps no call; the note says so)
        self.done = False

    def __call__(self, tracer: OpTracer, origin: OpFinding, finding: Finding) -> None:
        number = origin.node_number
        if self.done or finding.benign or number is None or origin.backward_code or origin.forward_source is None:
            return
        self.done = True
        if self.kept is None:
            finding.notes.append(Note.of("debug-not-replayed", reason=NOT_KEPT))
            return
        begun = [(root, root.nodes_before) for root in self.kept.calls if root.nodes_before is not None]
        root, start = next(((root, start) for root, start in reversed(begun) if start <= number), (None, 0))
        stop = line_stop_at(tracer, origin, start) if root is not None else None
        if root is None or stop is None:
            finding.notes.append(Note.of("debug-not-replayed", reason=NO_CALL))
            return
        self.kept.run_to_line(root, stop)
        if stop.frame is None:
            transformed = transformed_call(root.args, root.kwargs)
            finding.notes.append(Note.of("debug-not-replayed", reason=IN_TRANSFORM if transformed else NOT_REACHED))
            return
        finding.frame, finding.frame_position, finding.frame_calls = stop.frame, stop.position, stop.calls
        finding.notes.append(Note.of("debug-in-replay", step=self.step()))
