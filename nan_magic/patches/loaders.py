"""Which samples each ``DataLoader`` batch holds, while a watch needs to know.

A non-finite value made in a Dataset's ``__getitem__`` (a standardisation by a
zero std) reaches the watch as a bad batch, long after the code that made it
ran (in a worker process, or before the watch looked). To name that code's op
and line the watch fetches the batch's samples again (localize/replay/samples.py),
and for that it needs the batch's indices. The sampler is not touched: the
loader iterator's ``_next_index`` (which draws them from it, for the main
process or for a worker) is wrapped to note each one as drawn, and
``__next__`` to hand on the indices of the batch it returns. A worker's
batches come back in the order their indices were drawn (``in_order``, the
default); with ``in_order=False`` the batch's indices are not known.
Per batch this costs two Python calls, next to the loader's own dozens.

The loop-code recorder (localize/outside/recorder.py) may step aside while a batch is fetched
(:func:`unrecorded_batches`): a batch of 32 samples or more runs more ops than its data region's budget,
which would turn that region's recording off (its normalisation in the loop, a parameter written after
the optimizer step); the Dataset's own ops are named by fetching its samples again instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.data import dataloader

from nan_magic.patches.registry import ProcessPatch, Recorder, call_aside

__all__ = ["UNKNOWN", "unrecorded_batches", "watch_batches"]

#: The indices of a batch whose indices were drawn before the watch began, or out of order.
UNKNOWN = object()

#: ``callback(dataset, indices, map_style, collate)`` after each batch a loader iterator returns; ``collate``: its
#: ``collate_fn`` where a worker process ran it on the batch's samples, else None (this process ran it, watched).
BatchCallback = Callable[[Any, Any, bool, Any], None]

_callbacks: list[BatchCallback] = []
_recorders: list[Recorder] = []  # each recorder active
# Per live iterator: the indices drawn and not yet returned, by task number (a worker's), or at -1 (the main process).
_drawn: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


def _wrap_next_index(original: Callable[..., Any]) -> Callable[..., Any]:
    def _next_index(self: Any) -> Any:
        index = original(self)
        # A worker's task number is its ``_send_idx`` as the index is drawn; the main process fetches at once.
        _drawn.setdefault(self, {})[getattr(self, "_send_idx", -1)] = index
        return index

    return _next_index


def _wrap_next(original: Callable[..., Any]) -> Callable[..., Any]:
    def __next__(self: Any) -> Any:
        __tracebackhide__ = True
        data = call_aside(_recorders, original, self)
        drawn = _drawn.get(self, {})
        task = self._rcvd_idx - 1 if hasattr(self, "_rcvd_idx") else -1
        ordered = getattr(self, "_in_order", True)
        indices = drawn.pop(task, UNKNOWN) if ordered else UNKNOWN
        map_style = self._dataset_kind == dataloader._DatasetKind.Map
        collate = self._collate_fn if self._num_workers and self._auto_collation else None
        for callback in _callbacks:
            callback(self._dataset, indices, map_style, collate)
        return data

    return __next__


_PATCH = ProcessPatch(lambda: [
    (dataloader._BaseDataLoaderIter, "_next_index", _wrap_next_index),
    (dataloader._BaseDataLoaderIter, "__next__", _wrap_next),
])


@contextmanager
def watch_batches(callback: BatchCallback) -> Iterator[None]:
    """Call ``callback(dataset, indices, map_style, collate)`` after each batch a DataLoader returns inside the
    block."""
    with _PATCH.held((_callbacks, callback)):
        try:
            yield
        finally:
            if len(_callbacks) == 1:  # the last one goes as the block ends
                _drawn.clear()


@contextmanager
def unrecorded_batches(step_aside: Callable[[], bool], step_back: Callable[[], None]) -> Iterator[None]:
    """Inside the block, each batch a DataLoader fetches is fetched with the recorder stepped aside where
    ``step_aside()`` says it did, and brought back after (``step_back()``)."""
    with _PATCH.held((_recorders, (step_aside, step_back))):
        yield
