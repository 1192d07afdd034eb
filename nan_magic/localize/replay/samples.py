"""A bad batch from a Dataset: its samples fetched again under the op tracer, to name the op and line.

Data made in a map-style Dataset's ``__getitem__`` (a standardisation by a
zero std) ran before the watch judged the batch, often in a worker process.
The loader patch (patches/loaders.py) hands over the indices of each batch a
``DataLoader`` returns; at a data event, :meth:`Samples.localize` runs
``dataset[i]`` again for each index of the latest batch, in this process,
under the op tracer: the first op that made a non-finite value is the
producer, named at its line in ``__getitem__``. The user's loader is not
touched (no index is drawn, no worker asked) and the random generators
``__getitem__`` draws from (torch's, Python's, numpy's) are put back after.
A ``collate_fn`` a worker ran on the samples runs again on them too. An
iterable dataset, or a batch whose indices were not seen, is said in one
line of the report instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.kept.rng import generators_at
from nan_magic.localize.ops.origins import OpFinding, attach_origin
from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.localize.replay.untouched import user_generators
from nan_magic.patches.loaders import UNKNOWN
from nan_magic.records import Note, Phase, Report

__all__ = ["Refetched", "Samples"]

#: How many of the dataset indices whose samples hold the value a note lists.
_INDICES_SAID = 8

#: The op that made the batch's value, the frame that ran it and its ``(f_lasti, f_lineno)`` then; or a note.
Refetched = tuple[OpFinding, FrameType | None, tuple[int, int] | None] | Note


class Samples:
    """The latest batch a DataLoader returned under the watch, and its samples fetched again at an event."""

    def __init__(self, kinds: frozenset[str]) -> None:
        self.kinds = kinds
        self._dataset: Any = None
        self._indices: Any = UNKNOWN
        self._map_style = True
        self._collate: Callable[[list[Any]], Any] | None = None

    def on_batch(self, dataset: Any, indices: Any, map_style: bool, collate: Any = None) -> None:
        """The loader patch's callback: keep the latest batch's dataset, indices and a worker's ``collate_fn``
        (references only)."""
        self._dataset, self._indices, self._map_style, self._collate = dataset, indices, map_style, collate

    def forget(self) -> None:
        self._dataset, self._indices = None, UNKNOWN

    def localize(self, finding: Finding, seen: Report, build: Callable[[Finding], Report]
                 ) -> tuple[Report, tuple[FrameType | None, tuple[int, int] | None]] | None:
        """The report of a data event ``seen``, with the op and line that made it, or a note why not.

        None where no DataLoader returned a batch under the watch (the data was not fetched by one).
        """
        refetched = self.refetch()
        if refetched is None:
            return None
        if isinstance(refetched, Note):
            return dataclasses.replace(seen, note_facts=(*seen.note_facts, refetched)), (finding.frame, None)
        origin, frame, position = refetched
        attach_origin(finding, origin)
        finding.notes.append(Note.of("refetched", dataset=type(self._dataset).__name__))
        return build(finding), (frame, position)

    def refetch(self) -> Refetched | None:
        """The op in ``__getitem__`` that made the latest batch's non-finite value; None where no loader ran."""
        if self._dataset is None:
            return None
        name = type(self._dataset).__name__
        if not self._map_style:
            return Note.of("iterable-dataset", dataset=name)
        if self._indices is UNKNOWN:
            return Note.of("indices-unseen", dataset=name)
        indices = self._indices if isinstance(self._indices, list) else [self._indices]
        # Each sample is claimed as ops=True claims a boundary: the op whose value reached it, not an overflow
        # __getitem__ absorbed before it (``tanh(exp(100 * d))``).
        tracer = OpTracer(kinds=self.kinds, phase_hint=lambda: Phase.DATA, at_boundary=True)
        tracer.witnesses.hold = True  # (the origins' operands, freed as __getitem__ returns: the report's histograms)
        fetched: list[tuple[Any, Any]] = []  # (index, sample): a batch's worth, looked at once the tracer is off
        collate_error: Exception | None = None
        try:
            # The watch's own dispatch modes (the op tracer of ops=True, the loss-code recorder) stand aside.
            with _disable_current_modes(), user_generators(), generators_at(None), tracer:
                for index in indices:
                    fetched.append((index, self._dataset[index]))
                    tracer.claim_first([leaf for leaf in tree_leaves(fetched[-1][1]) if isinstance(leaf, torch.Tensor)])
                    if tracer.finding is not None:
                        break
                if tracer.finding is None and self._collate is not None:
                    with _disable_current_modes():
                        stored = any(_holds(sample, self.kinds) for _index, sample in fetched)
                    if not stored:  # (a sample that holds the value already says where: its index)
                        collate_error = self._collate_again(tracer, [sample for _index, sample in fetched])
        except Exception as error:  # the user's __getitem__ may not run twice (a file already closed)
            return Note.raised("refetch-raised", error, dataset=name)
        finally:
            tracer.witnesses.release()
        if collate_error is not None:
            return Note.raised("collate-raised", collate_error, dataset=name)
        with _disable_current_modes():
            holding = [] if tracer.finding is not None else [
                index for index, sample in fetched if _holds(sample, self.kinds)]
        del fetched
        if holding:
            # Stored (a TensorDataset's rows, a missing value read from a file): the user looks for it by index.
            return Note.of("refetch-stored", count=len(indices), dataset=name,
                           indices=tuple(_plain_index(index) for index in holding[:_INDICES_SAID]),
                           holding=len(holding))
        if tracer.finding is None:
            return Note.of("refetch-finite", count=len(indices), dataset=name)
        frame, position = tracer.frame_of(tracer.finding)
        return tracer.finding, frame, position


    def _collate_again(self, tracer: OpTracer, samples: list[Any]) -> Exception | None:
        """A worker ran the loader's collate_fn on the samples (``(x - x.mean(0)) / x.std(0)`` over the batch: a
        feature of one value), not this process's watch: it runs again here, under ``tracer``. Its own error (a
        collate that runs only in a worker) is returned, to be said as the collate's, not ``__getitem__``'s."""
        assert self._collate is not None
        try:
            batch = self._collate(samples)
        except Exception as error:
            return error
        tracer.claim_first([leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)])
        return None


def _holds(sample: Any, kinds: frozenset[str]) -> bool:
    """Whether a sample ``dataset[i]`` returned (a tensor, a tuple or dict of them) holds a value of ``kinds``."""
    for leaf in tree_leaves(sample):
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            if ("nan" in kinds and bool(leaf.isnan().any())) or ("inf" in kinds and bool(leaf.isinf().any())):
                return True
        elif isinstance(leaf, float) and (("nan" in kinds and leaf != leaf)
                                          or ("inf" in kinds and leaf in (float("inf"), float("-inf")))):
            return True
    return False


def _plain_index(index: Any) -> Any:
    """A dataset index as plain data (an int, a str key), for a note's facts; anything else as its repr."""
    if isinstance(index, torch.Tensor) and index.numel() == 1:
        return int(index.item())
    return index if isinstance(index, (int, str)) else repr(index)
