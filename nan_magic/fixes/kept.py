"""What a per-call (``mode="full"``) or traced (``ops=True``) watch's fix trials replay: the step's kept model call.

Those watches name the producer without a replay of the step (every module
call checked, every op traced), so the tiered watch's ``StepReplays.replayed``
(the call whose replay named the producer) is not there. They keep the step's
top-level calls all the same (localize/modes.py ``kept``), and the trials replay
the one that failed:

* a forward event in a model: the top-level call the producer's call ran in
  (the finding's call record, walked up), else the latest;
* a backward event in a model: each call that holds the gradient that flowed
  into its outputs, the latest first (backward runs the last call first), until
  one's unremedied replay goes non-finite (``head(body(x))``: the body's); else the latest;
* a producer in the loss code: the step's last call (the loss code reads its outputs);
* a batch that entered non-finite: the latest call given it (remedies/batch.py).

An immediate event in a forward stops that call before it returns: its keyword
arguments, which a global pre-hook never sees, are read from its running
``Module._call_impl`` frame (hot/kept/held.py), and the trials run before the
call goes on. The trials run with the watch's hooks and its dispatch modes (the
op tracer, the loop-code recorder) standing aside: their ops are not the user's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils._python_dispatch import _disable_current_modes

from nan_magic.fixes.loss import LossSource
from nan_magic.fixes.remedies.batch import holds_nonfinite
from nan_magic.hot.kept.held import running_arguments
from nan_magic.localize.replay.tiered.root_calls import RootCall
from nan_magic.localize.replay.tiered.step import StepReplays
from nan_magic.records import Note, Phase, Report

__all__ = ["KeptStep"]


@dataclass(frozen=True)
class KeptStep:
    """The step's kept top-level calls, the event's call record, the loss code, and how the watch stands aside."""

    #: The kept calls (localize/modes.py ``kept``); None where the watch keeps none (``replay=False``).
    replays: StepReplays | None
    #: Whether the op tracer watches every op (``ops=True``).
    traced: bool
    #: The watch's record of the call the event was found in (``Finding.call``), or None.
    call: object | None
    loss: LossSource
    #: The watch's hooks ignore the calls a trial makes (producer_call.CallReplay.standing_aside).
    standing_aside: Callable[[], contextlib.AbstractContextManager[None]]

    @classmethod
    def of(cls, localizing: Any, call: object | None, loss: LossSource,
           standing_aside: Callable[[], contextlib.AbstractContextManager[None]]) -> KeptStep:
        """What the watch's mode (localize/modes.py ``Localizing``) kept of the step, for ``call``'s event."""
        return cls(localizing.kept, localizing.traces, call, loss, standing_aside)

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """The watch's hooks and its dispatch modes (the op tracer, the loop-code recorder) stand aside."""
        with self.standing_aside(), _disable_current_modes():
            yield

    def failing_calls(self, report: Report) -> list[RootCall] | Note:
        """The kept calls the trials may replay, the likeliest first (the module docstring), with their keyword
        arguments; or why there is none."""
        calls = list(self.replays.calls) if self.replays is not None else []
        if not calls:
            return Note("fixes-no-call")
        roots: list[RootCall] = [calls[-1]]
        if report.phase == Phase.DATA:
            # None given the values: a value only the loss code read (runner.py says which, or why no trial).
            roots = [call for call in reversed(calls) if holds_nonfinite(call)][:1] or (
                [calls[-1]] if report.module is None else [])
        elif report.module is None:
            roots = [calls[-1]]  # the loss code, after the step's last call
        elif report.phase == Phase.FORWARD:
            top = self.call
            while top is not None and getattr(top, "parent", None) is not None:
                top = top.parent  # type: ignore[attr-defined]
            roots = [next((call for call in reversed(calls) if top is not None and call.call is top), calls[-1])]
        elif report.phase == Phase.BACKWARD:
            # Each call whose output gradient is held, the last first: the first whose replay fails is the one.
            roots = [call for call in reversed(calls) if call.output_grads] or [calls[-1]]
        if not roots:
            return Note("fixes-no-call")
        found: list[RootCall] = []
        for root in roots:
            if not root.returned:
                running = running_arguments(root.module)
                if running is None:
                    return Note("fixes-call-running")
                root = dataclasses.replace(root, kwargs=running[1])
            found.append(root)
        return found
