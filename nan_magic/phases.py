"""Where a producer ran: the phase of a training step (stdlib only, below the records and the references)."""

from __future__ import annotations

import enum

__all__ = ["Phase"]


class Phase(str, enum.Enum):
    """Where the producer ran (PRODUCT.md: *phase*).

    A ``str`` enum so that ``report.phase == "forward"`` holds.
    """

    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"

    def __str__(self) -> str:
        return self.value
