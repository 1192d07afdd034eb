"""What the loss-code recorder's records hold alive, and how they let go of it when ``backward()`` starts.

The recorder (recorder.py) keeps references, not copies: until ``backward()``
starts, the loss code's values stay alive as autograd would keep most of them
anyway. From then on a large tensor (a language model's logits) is held only
weakly, so it is freed when it would be unwatched; small ones stay for a
backward replay of a short loss. The sizes are counted as ops are recorded,
so the usual step, which holds small tensors only, rebuilds nothing.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch

from nan_magic.localize.outside.applied import Applied, applied_calls
from nan_magic.localize.outside.recorded_ops import RecordedOp, WeakRecord, swapped, weak_record

__all__ = [
    "KEEP_BYTES", "KEEP_TOTAL", "Calls", "bytes_held", "held_bytes", "returned_let_go", "small_frames",
    "storage_bytes", "weakened",
]

#: A recorded tensor whose storage is at most this size stays strongly held during ``backward()``
#: (a contrastive loss's distances), up to :data:`KEEP_TOTAL` in all; larger ones (a language
#: model's logits) are held weakly, freed as they would be unwatched.
KEEP_BYTES = 1 << 20
KEEP_TOTAL = 8 << 20


def storage_bytes(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(storage key, bytes)`` of what holding ``tensor`` keeps alive (a view keeps its whole base), or None."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # no storage of its own (sparse, nested, a subclass)
        return None


#: Where each frame that ran recorded ops was called: the calling frame, its f_lasti and line then (recorder.py).
Calls = dict[FrameType, tuple[FrameType, int, int] | None]


def returned_let_go(ops: list[RecordedOp], calls: Calls, keep_small: bool
                    ) -> tuple[list[RecordedOp], Calls, dict[int, Applied]] | None:
    """``ops`` with the frames of functions that returned let go (a held frame keeps its locals), ``calls`` as far as
    they stay, and the custom Functions' applies among the ops (outside/applied.py); None where every frame the ops
    hold is still running (the usual loss, written in the loop's own frame): nothing to let go.

    With ``keep_small``, a returned frame whose tensors are small stays (:func:`small_frames`: %debug opens there at
    the op), and so do the calls noted for the frames kept, but a caller's that returned and is let go (its frame
    would keep its locals alive; a small one stays too); else no call stays (judged already: asked no more).
    One walk up the stack serves the frames and their callers (a step whose loss ran in a helper asks both); it stops
    where the last of the frames is found running.
    """
    held = {op[8] for op in ops} - _NO_FRAME  # (op.frame: no attribute lookup per op)
    if not held:
        return None
    on_stack: list[FrameType] = []
    running: set[FrameType] = set()
    frame: FrameType | None = sys._getframe(1)  # (not this one: the list would hold its own frame, a cycle)
    while frame is not None:
        if frame in held:
            running |= {frame}
            if running == held:  # (the usual loss: up to the loop's frame, not the notebook's frames above it)
                return None
        on_stack += (frame,)  # (no call per frame)
        frame = frame.f_back
    stack = set(on_stack)
    # (A custom Function's forward is such a frame: its apply, noted for a backward replay.)
    applied = applied_calls(ops, held - running, running, calls)
    if keep_small:
        running |= small_frames(held - running)
        returned: set[FrameType] = set()
        for site in calls.values():  # (a loop, not a comprehension: that is one call more a step)
            if site is not None and site[0] not in running and site[0] not in stack:
                returned |= {site[0]}
        alive = running | stack
        if returned:
            alive |= small_frames(returned)
        kept: Calls = {}
        for frame, site in calls.items():
            if frame in alive and site is not None and site[0] in alive:
                kept[frame] = site
    else:
        kept = {}
    if running == held:  # (a returned helper's small frame, kept: the records as they are)
        return ops, kept, applied
    # (The record again with no frame: tuple.__new__ directly, one call; a named tuple's _replace is four.)
    return ([op if op[8] is None or op[8] in running else _new_tuple(RecordedOp, (*op[:8], None)) for op in ops],
            kept, applied)


def small_frames(frames: set[FrameType]) -> set[FrameType]:
    """Those of ``frames`` (functions that returned) whose tensor locals are small enough to keep alive.

    A returned helper's frame (``loss_fn(out, y)``) is where ``%debug`` opens at its op; holding it keeps its
    locals alive. Kept while what its tensors hold (directly, or one container deep: a list, a tuple, a dict or
    a ``ModelOutput``; a view counts its base, each base once) stays within :data:`KEEP_TOTAL` with what the
    frames kept before it hold; a tensor over :data:`KEEP_BYTES` (a language model's logits) lets it go.
    Asked once a step where the deferred check's loss code ran in a helper: sizes are read as attributes
    (:func:`bytes_held`'s way), no call per tensor.
    """
    kept: set[FrameType] = set()
    seen: dict[int, int] = {}
    total = 0
    for frame in frames:
        sizes: dict[int, int] = {}
        for value in frame.f_locals.values():
            kind = type(value)
            if kind is torch.Tensor:
                items: Any = (value,)
            elif kind is list or kind is tuple:
                items = value
            elif dict in kind.__mro__:  # (a ModelOutput too; `in` on a tuple is no call: asked for every local)
                items = value.values()
            elif torch.Tensor in kind.__mro__:
                items = (value,)
            else:
                continue
            for item in items:
                kind = type(item)
                if kind is torch.Tensor:
                    base = item._base
                    whole = item if base is None else base
                    sizes[id(whole)] = (whole.nbytes if type(whole) is torch.Tensor and whole.layout is torch.strided
                                        else _storage_size(whole))  # (sparse COO: no nbytes, no storage)
                elif kind is not torch.nn.Parameter and torch.Tensor in kind.__mro__:  # (a parameter: alive anyway)
                    sizes[id(item)] = _storage_size(item)
        new = 0
        for key, nbytes in sizes.items():
            if key not in seen:
                new += nbytes if nbytes <= KEEP_BYTES else KEEP_TOTAL + 1
        if total + new <= KEEP_TOTAL:
            kept |= {frame}
            seen |= sizes
            total += new
    return kept


def _storage_size(tensor: torch.Tensor) -> int:
    """The bytes of a tensor subclass's storage, or of a sparse tensor's parts; past :data:`KEEP_TOTAL` where it has
    neither."""
    parts = _SPARSE_PARTS.get(tensor.layout)
    if parts is not None:
        # A sparse tensor has no storage of its own: what holding it keeps alive is its index and value tensors (a
        # GCN's normalised adjacency built in a data helper: small, and that helper's frame is where %debug opens).
        try:
            return sum(getattr(tensor, part)().nbytes for part in parts)
        except RuntimeError:  # (a sparse tensor of a subclass, a meta one: unmeasured)
            return KEEP_TOTAL + 1
    size = storage_bytes(tensor)
    return KEEP_TOTAL + 1 if size is None else size[1]


#: The tensors a sparse layout's values live in, by the methods that return them.
_SPARSE_PARTS: dict[torch.layout, tuple[str, ...]] = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def bytes_held(tensor: torch.Tensor) -> int:
    """:func:`held_bytes` of a plain dense tensor, with no call: its base's size (a view keeps its whole base).

    The recorder counts this for every tensor of every op it records; a tensor with no storage of its
    own is never a plain ``torch.Tensor``, and a storage larger than its base (``set_``) is rare enough to
    be under-counted here: :meth:`OutsideRecorder.weaken` measures storages when the total is large.
    """
    base = tensor._base
    try:
        size = (tensor if base is None else base).nbytes
    except RuntimeError:  # a sparse COO tensor has no nbytes (nor a storage of its own): held weakly
        return KEEP_TOTAL + 1
    return KEEP_TOTAL + 1 if size > KEEP_BYTES else size


def held_bytes(tensor: torch.Tensor) -> int:
    """What holding ``tensor`` keeps alive, as :meth:`OutsideRecorder.weaken`'s shortcut counts it: a large
    one (or one with no storage of its own) past :data:`KEEP_TOTAL` by itself, so that it is held weakly."""
    size = storage_bytes(tensor)
    return KEEP_TOTAL + 1 if size is None or size[1] > KEEP_BYTES else size[1]


def weakened(ops: list[RecordedOp], keep_total: int = KEEP_TOTAL) -> list[RecordedOp]:
    """``ops`` with each tensor they hold made a :class:`WeakRecord`: one that keeps its values where it is small
    (each storage under :data:`KEEP_BYTES`, all under ``keep_total``), a weak reference otherwise."""
    kept: set[int] = set()  # storages held, each counted once
    total = 0
    made: dict[int, WeakRecord] = {}  # one record per tensor: an op's output is often the next op's input

    def weak_unless_small(value: torch.Tensor) -> Any:
        weak = made.get(id(value))
        if weak is None:
            weak = made[id(value)] = weaken_one(value)
        return weak

    def weaken_one(value: torch.Tensor) -> WeakRecord:
        nonlocal total
        size = storage_bytes(value)
        if size is not None and (size[0] in kept or (size[1] <= KEEP_BYTES and total + size[1] <= keep_total)):
            if size[0] not in kept:
                kept.add(size[0])
                total += size[1]
            return weak_record(value, keep=True)
        return weak_record(value)

    return [
        op._replace(args=swapped(weak_unless_small, op.args),
                    kwargs=swapped(weak_unless_small, op.kwargs) if op.kwargs else op.kwargs,
                    out=swapped(weak_unless_small, op.out))
        for op in ops
    ]


_new_tuple = tuple.__new__
_NO_FRAME = frozenset((None,))
