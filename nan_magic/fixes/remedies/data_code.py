"""A remedy at a producer in the loop's data code: the batch made again with it, and the step replayed on that.

``x = (raw - raw.mean(0)) / raw.std(0)`` on a constant feature divides by 0
before the model runs: the event is the batch entering the model (phase
``data``), and its producer the division, named by the recorder of the
code outside the models (localize/outside/). The trial runs that code's
recorded ops again on copies of what they read, with the remedy applied at
the producer's line (fixes/site.py's ``InRecordedCode``), and
replays the failing step with the remedied batch in place of the bad one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from nan_magic.fixes.site import InRecordedCode
from nan_magic.fixes.step import FailingStep
from nan_magic.hot.kept.rng import generators_at
from nan_magic.hot.reads import iter_tensors, values_to_read
from nan_magic.localize.outside.recorded_ops import Gone, RecordedOp, copies_from_outside, record_key, rerun_op
from nan_magic.localize.outside.region_records import RegionRecords
from nan_magic.localize.replay.module_run import map_tensors
from nan_magic.note_records import Note

__all__ = ["remedied_batch"]


def remedied_batch(step: FailingStep, records: RegionRecords, remedy: InRecordedCode) -> FailingStep | Note:
    """``step`` with each non-finite tensor of its batch made again by the data code under ``remedy``; or why not."""
    root = step.root
    bad = [tensor for _path, tensor in iter_tensors((root.args, root.kwargs))
           if tensor.is_floating_point() and not bool(torch.isfinite(values_to_read(tensor)).all())]
    remade: dict[int, torch.Tensor] = {}
    for tensor in bad:
        found = records.data_code(tensor)
        if found is None:
            return Note("batch-not-recorded")
        ops, rng = found
        if _written_in_place(ops, tensor):
            return Note("batch-written-in-place")
        try:
            copies, _requiring = copies_from_outside(ops)
            with torch.no_grad(), generators_at(rng):
                for op in ops:
                    rerun_op(op, copies, remedy.run)
        except Gone:
            return Note("data-input-freed")
        remade[id(tensor)] = copies[id(tensor)]

    def swap(tensor: torch.Tensor) -> Any:
        return remade.get(id(tensor), tensor)

    batch = dataclasses.replace(root, args=map_tensors(swap, root.args), kwargs=map_tensors(swap, root.kwargs))
    return dataclasses.replace(step, root=batch)


def _written_in_place(ops: list[RecordedOp], tensor: torch.Tensor) -> bool:
    """Whether ``ops`` read ``tensor`` before any of them returned it: a value from outside that they wrote in place
    (``prompt.sub_(lr * g / g.norm())``, a soft prompt stepped by hand). Its copy would start from the value the
    write left, so the code run again under a remedy would start from the non-finite value it is meant to avoid."""
    key = id(tensor)
    for op in ops:
        if any(record_key(value) == key for value in tree_leaves((op.args, op.kwargs))):
            return True
        if any(record_key(value) == key for value in tree_leaves(op.out)):
            return False
    return False
