"""The crash scene: everything needed to re-run the failing step offline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nan_magic.records import Report

if TYPE_CHECKING:  # pragma: no cover
    from nan_magic.engine.findings import Finding
    from nan_magic.engine.watch import Watch

__all__ = ["record_scene"]


def record_scene(watch: Watch, finding: Finding, report: Report) -> Report:
    """At the first real event: save the scene (``dump``), arm ``restore``; return the report."""
    return report
