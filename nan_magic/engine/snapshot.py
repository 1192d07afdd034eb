"""Roll back: the state of the last step that ended finite."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nan_magic.records import Report

if TYPE_CHECKING:  # pragma: no cover
    from nan_magic.engine.watch import Watch

__all__ = ["LastGood", "restore"]


class LastGood:
    """Keeps the model's and optimizer's state after each finite step (when asked to)."""

    def __init__(self, where: str | None) -> None:
        self.where = where

    def capture(self, watch: Watch) -> None:
        """Copy the watched state after a step that ended finite."""


def restore(report: Report) -> None:
    """Put back the state kept for ``report``."""
    raise RuntimeError("this report has no kept state: watch with keep_last_good='cpu' or 'device'")
