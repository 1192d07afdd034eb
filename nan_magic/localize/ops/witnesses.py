"""What an op that started a non-finite value leaves for the report: its tensors and the user's frame.

The op tracer (ops/tracer.py) notes, for each origin it starts, weak
references to the op's output and tensor inputs (the report's histograms
copy those still alive when the origin is claimed) and, for a forward op or
a Python backward, the user's frame that ran it, where ``%debug`` opens
(line_state.py). Both are forgotten at a new step, but for origins kept
across it (the batch a step's first model call receives).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from types import FrameType

import torch

from nan_magic.errors.line_state import LineEnd, after_line
from nan_magic.localize.ops.origins import OpFinding
from nan_magic.localize.ops.sources import Caller, Chain, calls_from_caller, live_calls, replayed_calls

__all__ = ["OpWitnesses"]


class OpWitnesses:
    """Per origin finding: weak ``(label, tensor)`` of its op's output then inputs, and its user frame."""

    def __init__(self) -> None:
        self._tensors: dict[int, tuple[tuple[str, weakref.ref[torch.Tensor]], ...]] = {}
        #: Hold them too, while the tracer runs (a replay that claims its output once it returned, when the op's
        #: temporary operands are freed: the report's histograms need them). Set by the replay.
        self.hold = False
        self._held: list[tuple[torch.Tensor | None, ...]] = []
        # Their version counters when the op ran: a tensor written in place since no longer shows what it made.
        self._versions: dict[int, tuple[int | None, ...]] = {}
        self._frames: dict[int, LineEnd] = {}
        #: How a replay reached the frame (sources.replayed_calls); absent for a live trace's.
        self._calls: dict[int, tuple[Caller | None, Chain]] = {}
        #: A live trace's: the user's frames above the op's, as they called the next (sources.live_calls).
        self._live: dict[int, Chain] = {}

    def note(self, finding: OpFinding, tensors: Sequence[tuple[str, weakref.ref[torch.Tensor]]],
             frame: FrameType | None, in_place: bool = False, at: tuple[int, int] | None = None) -> None:
        """``at``: the op's ``(f_lasti, f_lineno)`` in ``frame`` where it ran on a line that has ended since (a pick
        named by a later op of the same frame: origins.Picked); the locals are then the ones the current line leaves."""
        self._tensors[id(finding)] = tuple(tensors)
        if self.hold:
            self._held.append(tuple(ref() for _label, ref in tensors))
        # (An in-place op's output moves once more after the op returns: autograd's bump, counted here.)
        self._versions[id(finding)] = tuple(
            None if (version := _version(ref())) is None else version + (in_place and index == 0)
            for index, (_label, ref) in enumerate(tensors))
        if frame is not None:
            end = after_line(frame) if at is None else LineEnd(frame)
            if at is not None:
                end.lasti, end.lineno = at
            self._frames[id(finding)] = end
            calls = replayed_calls(frame)
            if calls is not None:
                self._calls[id(finding)] = calls
            else:
                self._live[id(finding)] = live_calls(frame)

    def release(self) -> None:
        """Let go of the tensors :attr:`hold` kept (the claim has copied its finding's)."""
        self._held.clear()

    def keep_only(self, findings: Sequence[OpFinding]) -> None:
        """Forget every finding's witnesses but those of ``findings`` (a new step)."""
        kept = {id(finding) for finding in findings}
        self._held.clear()
        self._tensors = {key: value for key, value in self._tensors.items() if key in kept}
        self._versions = {key: value for key, value in self._versions.items() if key in kept}
        self._frames = {key: value for key, value in self._frames.items() if key in kept}
        self._calls = {key: value for key, value in self._calls.items() if key in kept}
        self._live = {key: value for key, value in self._live.items() if key in kept}

    def frame_of(self, finding: OpFinding) -> tuple[FrameType | None, tuple[int, int] | None]:
        """The user's frame that ran the op, and its ``(f_lasti, f_lineno)`` then; ``(None, None)`` if unknown."""
        return self._frames[id(finding)].where() if id(finding) in self._frames else (None, None)

    def calls_of(self, finding: OpFinding) -> Chain:
        """The frames from the user's frame that called the model to the op's: through the replay that reached it
        (sources.replayed_calls, where that caller still runs), or as a live trace's ran (sources.live_calls)."""
        replayed = self._calls.get(id(finding))
        return calls_from_caller(replayed) if replayed is not None else self._live.get(id(finding), ())

    def output_of(self, finding: OpFinding) -> torch.Tensor | None:
        """The op's output while it lives: a replay of recorded ops finds the record that made it by it."""
        tensors = self._tensors.get(id(finding))
        return tensors[0][1]() if tensors else None

    def copies(self, finding: OpFinding) -> tuple[tuple[str, torch.Tensor], ...]:
        """Copies of the op's output, then of its inputs still alive; none when the output is gone.

        An intermediate output is often freed by the boundary where it is
        claimed: the finding's statistics then stand for it and its inputs.
        """
        alive: list[tuple[str, torch.Tensor | None]] = []
        for (label, ref), noted in zip(self._tensors.get(id(finding), ()), self._versions.get(id(finding), ())):
            tensor = ref()
            if tensor is not None and noted is not None and _version(tensor) != noted:
                tensor = None  # written in place since (``q /= q.sum(1)`` after ``q = exp(s)``): not what it was
            alive.append((label, tensor))
        if not alive or alive[0][1] is None:
            return ()  # (the finding's statistics, taken as the op ran, stand for the output and its inputs)
        return tuple((label, tensor.detach().clone()) for label, tensor in alive if tensor is not None)


def _version(tensor: torch.Tensor | None) -> int | None:
    """A tensor's version counter; None for an inference tensor (it has none) or a tensor gone."""
    return tensor._version if tensor is not None and not tensor.is_inference() else None
