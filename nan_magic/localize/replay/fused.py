"""PyTorch's fused inference kernels, replayed apart.

In eval under ``no_grad``, ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` take a "fast path": one
fused op for the whole layer (``aten._transformer_encoder_layer_fwd``), whose submodules never run as calls. A
replay that names that op names no more than the layer. Run again with the fast path off
(``torch.backends.mha.set_fastpath_enabled(False)``, put back after), the layer runs its own submodules and ops, which
name the producer inside it; where that replay finds nothing, the fused op stands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from nan_magic.records import Note

__all__ = ["FUSED_LAYERS", "apart_note", "fast_path_off", "is_fused"]

#: The fused whole-layer ops of torch.backends.mha's fast path.
FUSED_LAYERS = frozenset({"aten._transformer_encoder_layer_fwd.default", "aten._native_multi_head_attention.default"})


def is_fused(op: str | None) -> bool:
    """Whether ``op`` is a fused layer that a replay with the fast path off can take apart (the path is on now)."""
    return op in FUSED_LAYERS and torch.backends.mha.get_fastpath_enabled()


@contextlib.contextmanager
def fast_path_off() -> Iterator[None]:
    """torch.backends.mha's fast path off, and on again after (a process-wide switch: entered only while on)."""
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def apart_note(fused: str | None) -> Note:
    """What the report says of a producer named with the fused layer ``fused`` taken apart."""
    return Note.of("fused-apart", fused=fused)
