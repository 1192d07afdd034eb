"""nan_magic: find where a NaN or Inf was born in a PyTorch run.

``import nan_magic`` loads the engine only (torch, no IPython, pandas,
ipywidgets or matplotlib), so scripts and CI can use :func:`watch` directly.
In IPython, ``%load_ext nan_magic`` adds ``%%nantrace`` and ``%nanwatch``.
"""

from __future__ import annotations

from typing import Any

from nan_magic.errors.exceptions import NanMagicWarning, NonFiniteError, PeerNonFiniteError
from nan_magic.lifecycle.watch import Watch, watch
from nan_magic.patches.checkpoint_guard import CheckpointGuard, guard_checkpoints
from nan_magic.records import (
    Cause,
    EarlyWarning,
    LayerCall,
    Phase,
    Report,
    SourcePointer,
    StepSummary,
    TensorRef,
    TensorRole,
    TensorStats,
    WatchConfig,
)
from nan_magic.scene.load import Scene, load_scene

__all__ = [
    "Cause",
    "CheckpointGuard",
    "EarlyWarning",
    "LayerCall",
    "NanMagicWarning",
    "NonFiniteError",
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
    "guard_checkpoints",
    "load_ipython_extension",
    "load_scene",
    "unload_ipython_extension",
    "watch",
]

__version__ = "0.1.0"


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nan_magic``: register the magics (imported lazily)."""
    from nan_magic.ipython.magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nan_magic``: disarm every watch and remove the magics."""
    from nan_magic.ipython.magics import unload

    unload(ipython)
