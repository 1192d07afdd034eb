"""nan_magic: find where a NaN or Inf was born in a PyTorch run.

``import nan_magic`` loads the engine only (torch, no IPython, pandas,
ipywidgets or matplotlib), so scripts and CI can use :func:`watch` directly.
In IPython, ``%load_ext nan_magic`` adds ``%%nantrace`` and ``%nanwatch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nan_magic.errors.exceptions import NanMagicWarning, NonFiniteError, PeerNonFiniteError
from nan_magic.fix_records import install_describer
from nan_magic.lifecycle.entry import watch
from nan_magic.lifecycle.watch import Watch
from nan_magic.note_records import Note, install_writer
from nan_magic.options import WatchConfig
from nan_magic.patches.checkpoint_guard import CheckpointGuard, guard_checkpoints
from nan_magic.records import (
    Cause,
    EarlyWarning,
    EventRef,
    FixTrial,
    LayerCall,
    Phase,
    Report,
    Sample,
    SourcePointer,
    StepSummary,
    TensorRef,
    TensorRole,
    TensorStats,
    install_views,
)
from nan_magic.render.words.names import sample_label, tensor_label
from nan_magic.scene.load import Scene, load_scene
from nan_magic.tensor_refs import install_labeler
from nan_magic.version import __version__

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

__all__ = [
    "Cause",
    "CheckpointGuard",
    "EarlyWarning",
    "EventRef",
    "FixTrial",
    "LayerCall",
    "NanMagicWarning",
    "NonFiniteError",
    "Note",
    "PeerNonFiniteError",
    "Phase",
    "Report",
    "Scene",
    "SourcePointer",
    "StepSummary",
    "TensorRef",
    "TensorRole",
    "TensorStats",
    "Watch",
    "WatchConfig",
    "__version__",
    "guard_checkpoints",
    "load_ipython_extension",
    "load_scene",
    "unload_ipython_extension",
    "watch",
]



class _Views:
    """A Report's views: rendering and the roll-back, imported on first use (``import nan_magic`` stays light)."""

    def table(self, report: Report) -> pd.DataFrame:
        from nan_magic.render.table import layer_table

        return layer_table(report)

    def text(self, report: Report) -> str:
        from nan_magic.render.text import render_text

        return render_text(report)

    def message_parts(self, report: Report) -> tuple[str, str, str, str]:
        from nan_magic.render.words.message import message_parts

        return message_parts(report)

    def html(self, report: Report) -> str:
        from nan_magic.render.html import render_html

        return render_html(report)

    def mimebundle(self, report: Report) -> dict[str, Any]:
        from nan_magic.render.display import mimebundle

        return mimebundle(report)

    def restore(self, report: Report) -> None:
        from nan_magic.scene.last_good import restore

        restore(report)

    def cause_hint(self, cause: Cause) -> str:
        from nan_magic.render.words.cause import cause_hint

        return cause_hint(cause)

    def cause_evidence(self, cause: Cause) -> tuple[str, ...]:
        from nan_magic.render.words.cause import cause_evidence

        return cause_evidence(cause)

    def warning_message(self, kind: str, facts: tuple[tuple[str, Any], ...]) -> str:
        from nan_magic.render.words.warning_words import warning_text

        return warning_text(kind, facts)

    def sample_label(self, sample: Sample) -> str:
        return sample_label(sample)


install_views(_Views())


def _describe_fix(trial: FixTrial) -> str:
    from nan_magic.render.fixes import fix_description

    return fix_description(trial)


# A FixTrial's description is written by render/fixes.py, imported on first use.
install_describer(_describe_fix)
def _write_note(note: Note) -> str:
    from nan_magic.render.words.note_words import note_text

    return note_text(note)


# A Note's sentence is written by render/words/note_words.py, imported on first use.
install_writer(_write_note)
# A TensorRef's label (str) is written by render/words/names.py (stdlib only, so imported at once).
install_labeler(tensor_label)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nan_magic``: register the magics (imported lazily)."""
    from nan_magic.ipython.magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nan_magic``: disarm every watch and remove the magics."""
    from nan_magic.ipython.magics import unload

    unload(ipython)
