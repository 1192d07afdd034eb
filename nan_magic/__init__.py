"""nan_magic: find where a NaN or Inf was born in a PyTorch run.

``import nan_magic`` loads the engine only (torch, no IPython, pandas,
ipywidgets or matplotlib), so scripts and CI can use :func:`watch` directly.
In IPython, ``%load_ext nan_magic`` adds ``%%nantrace`` and ``%nanwatch``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

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


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported at its first call (``import nan_magic`` stays light)."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args)

    return call


class _Views:
    """A Report's views: rendering and the roll-back, imported on first use."""

    table = staticmethod(_lazy("nan_magic.render.table", "layer_table"))
    text = staticmethod(_lazy("nan_magic.render.text", "render_text"))
    message_parts = staticmethod(_lazy("nan_magic.render.words.message", "message_parts"))
    html = staticmethod(_lazy("nan_magic.render.html", "render_html"))
    mimebundle = staticmethod(_lazy("nan_magic.render.display", "mimebundle"))
    restore = staticmethod(_lazy("nan_magic.scene.last_good", "restore"))
    cause_hint = staticmethod(_lazy("nan_magic.render.words.causes.readings", "cause_hint"))
    cause_evidence = staticmethod(_lazy("nan_magic.render.words.causes.readings", "cause_evidence"))
    warning_message = staticmethod(_lazy("nan_magic.render.words.warning_words", "warning_text"))
    sample_label = staticmethod(sample_label)


install_views(_Views())
# A FixTrial's description is written by render/fixes.py, a Note's sentence by render/words/note_words.py.
install_describer(_lazy("nan_magic.render.fixes", "fix_description"))
install_writer(_lazy("nan_magic.render.words.note_words", "note_text"))
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
