"""The ``torch.autograd.graph.saved_tensors_hooks`` a call ran under, for a replay that runs after the user's ``with``.

A loop that halves its activation memory packs every tensor autograd saves (``with saved_tensors_hooks(pack,
unpack): loss = model(x)``): to float16, to the CPU, compressed. The backward computes from the unpacked copies, so
a value the pack rounded to inf (a ReLU output past 65504) makes a NaN gradient that no forward boundary held. The
hooks are a thread-local stack in torch that the loop's ``with`` leaves before ``backward()``; a replay of the call
at the event runs the forward again outside them, saves the activations as they are, and stays finite.

So the watch keeps its own list of the hook contexts entered while it is active (patches/saved_hooks.py wraps the
context's enter and exit), and each kept call notes the innermost as it starts: a list's truth and an index, no
Python call on the healthy step. A replay enters the same pair again (:func:`saved_hooks_of`). Not seen: hooks
pushed before the watch began, or through torch's private push rather than the context manager. Checkpointing's own
contexts (``torch.utils.checkpoint``) are not listed: their hooks hold the frame of the checkpoint that is running,
and a replay inlines or recomputes checkpoints itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ENTERED", "saved_hooks_of"]

#: The user's ``saved_tensors_hooks`` contexts entered while a watch is active, innermost last (the one in effect).
ENTERED: list[Any] = []


@contextlib.contextmanager
def saved_hooks_of(entered: Any) -> Iterator[None]:
    """Inside the block, the pack and unpack hooks of ``entered`` (a context a call noted as it started) are in
    effect for what autograd saves; with None, nothing changes."""
    if entered is None:
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(entered.pack_hook, entered.unpack_hook):
        yield
