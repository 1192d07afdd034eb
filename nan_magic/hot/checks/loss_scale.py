"""Loss scaling by hand: ``(loss * 2**16).backward()`` without a GradScaler (apex's, fairseq's, DeepSpeed's, a
float16 loop's own), the loop skipping a step whose scaled gradients overflowed (its clip norm or finiteness check
says so) and lowering its scale.

The backward's root says the loss was scaled: a multiplication by a power of two of at least 2 (a ``MulBackward0``
whose saved ``other`` is one number), taken as the backward starts by attribute reads only (the healthy step makes
no call for it: gradients.py) and read only at an event. A non-finite gradient of such a backward, in a loop with an
optimizer in use, is held as a GradScaler's is (optim.py). A step boundary that no optimizer step preceded settles
it as a benign skip; an optimizer step that applies it, the watch left before the loop decided, or
``COLLAPSE_SKIPS`` skips in a row raise it as it was found.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nan_magic.hot.kept.finding import Finding
from nan_magic.records import Note

__all__ = ["MUL_NODE", "loss_scale_of", "skipped_by_hand"]

#: The autograd node of ``loss * scale``.
MUL_NODE: Any = torch._C._functions.MulBackward0  # type: ignore[attr-defined]


def loss_scale_of(saved: torch.Tensor | None) -> float | None:
    """The scale a backward's loss was multiplied by, where it is a power of two of at least 2 (None otherwise)."""
    if not isinstance(saved, torch.Tensor) or saved.numel() != 1 or saved.device.type != "cpu":
        return None  # (a CUDA number is never read here: no synchronisation)
    value = float(saved)
    return value if math.isfinite(value) and value >= 2 and math.frexp(value)[0] == 0.5 else None


def skipped_by_hand(finding: Finding, scale: float | None, in_a_row: int, decided: bool) -> bool:
    """The held ``finding`` of a backward scaled by ``scale`` by hand, whose step the loop skipped (``decided``:
    it did; False where the watch was left first or the skips collapse): benign, with its note."""
    if decided and scale is not None:
        finding.benign = True
        finding.notes.append(Note.of("loss-scale-skipped", in_a_row=in_a_row, scale=scale))
    return finding.benign
