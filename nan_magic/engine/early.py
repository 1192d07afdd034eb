"""Early warnings: signs that a run is heading for a non-finite value.

Fed one :class:`StepSummary` per step (and the batch entering the model),
they compare against running statistics and return :class:`EarlyWarning`
records; the watch shows them in the report and, in ``warn`` mode, as they
happen.
"""

from __future__ import annotations

import torch

from nan_magic.records import EarlyWarning, StepSummary

__all__ = ["EarlyWarnings"]


class EarlyWarnings:
    """Running state of the early-warning rules for one watch."""

    def observe_step(self, summary: StepSummary) -> list[EarlyWarning]:
        """Warnings raised by one completed step."""
        return []

    def observe_batch(self, step: int, name: str, tensor: torch.Tensor) -> list[EarlyWarning]:
        """Warnings about one floating tensor entering a watched model."""
        return []
