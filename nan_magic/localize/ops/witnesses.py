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
from nan_magic.localize.ops.sources import Caller, Chain, replayed_calls

__all__ = ["OpWitnesses"]


class OpWitnesses:
    """Per origin finding: weak ``(label, tensor)`` of its op's output then inputs, and its user frame."""

    def __init__(self) -> None:
        self._tensors: dict[int, tuple[tuple[str, weakref.ref[torch.Tensor]], ...]] = {}
        self._frames: dict[int, LineEnd] = {}
        #: How a replay reached the frame (sources.replayed_calls); absent for a live trace's.
        self._calls: dict[int, tuple[Caller | None, Chain]] = {}

    def note(self, finding: OpFinding, tensors: Sequence[tuple[str, weakref.ref[torch.Tensor]]],
             frame: FrameType | None) -> None:
        self._tensors[id(finding)] = tuple(tensors)
        if frame is not None:
            self._frames[id(finding)] = after_line(frame)
            calls = replayed_calls(frame)
            if calls is not None:
                self._calls[id(finding)] = calls

    def keep_only(self, findings: Sequence[OpFinding]) -> None:
        """Forget every finding's witnesses but those of ``findings`` (a new step)."""
        kept = {id(finding) for finding in findings}
        self._tensors = {key: value for key, value in self._tensors.items() if key in kept}
        self._frames = {key: value for key, value in self._frames.items() if key in kept}
        self._calls = {key: value for key, value in self._calls.items() if key in kept}

    def frame_of(self, finding: OpFinding) -> tuple[FrameType | None, tuple[int, int] | None]:
        """The user's frame that ran the op, and its ``(f_lasti, f_lineno)`` then; ``(None, None)`` if unknown."""
        return self._frames[id(finding)].where() if id(finding) in self._frames else (None, None)

    def calls_of(self, finding: OpFinding) -> tuple[Caller | None, Chain] | None:
        """How a replay reached the frame that ran the op (sources.replayed_calls), or None."""
        return self._calls.get(id(finding))

    def copies(self, finding: OpFinding) -> tuple[tuple[str, torch.Tensor], ...]:
        """Copies of the op's output, then of its inputs still alive; none when the output is gone.

        An intermediate output is often freed by the boundary where it is
        claimed: the finding's statistics then stand for it and its inputs.
        """
        alive = [(label, ref()) for label, ref in self._tensors.get(id(finding), ())]
        if not alive or alive[0][1] is None:
            return ()
        return tuple((label, tensor.detach().clone()) for label, tensor in alive if tensor is not None)
