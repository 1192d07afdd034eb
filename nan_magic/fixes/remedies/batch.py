"""``skip-batch``: the failing step replayed without the samples whose data is non-finite.

A batch that enters the model holding NaN or inf (a corrupt record, a
division in the data pipeline): the samples are the rows of the call's
tensors along their first dimension. The rows where any argument of that
batch size holds a non-finite value are left out of every such argument,
and the step is replayed on the rest. A tensor not in the strided (dense)
layout (a sparse graph Laplacian or adjacency beside the batch) has no rows
that are samples: it is passed whole; where the non-finite values are its
own, no sample can be left out (:func:`sparse_nonfinite`). The loss code's targets are outside
the model call: its replay (fixes/loss.py) and the suggested edit drop the same rows from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from nan_magic.fixes.no_remedy import none_fit
from nan_magic.fixes.step import FailingStep
from nan_magic.hot.kept.call_records import array_values
from nan_magic.hot.reads import iter_tensors, values_to_read
from nan_magic.localize.replay.module_run import map_tensors
from nan_magic.localize.replay.tiered.root_calls import RootCall
from nan_magic.records import Note, Report

__all__ = ["holds_nonfinite", "outside_note", "sparse_nonfinite", "trained_argument", "unsliced_nonfinite",
           "without_bad_samples"]


def holds_nonfinite(root: RootCall) -> bool:
    """Whether the call's arguments hold a non-finite value (the batch it was given)."""
    return any(not bool(torch.isfinite(values_to_read(tensor)).all())
               for _path, tensor in iter_tensors((root.args, root.kwargs)) if tensor.is_floating_point())


def unsliced_nonfinite(root: RootCall) -> bool:
    """Whether the call's batch holds non-finite values where skip-batch cannot leave samples out: in a numpy array
    or among an object's attributes (a graph's ``Data``), which the watch reads as the batch (checks/forward.py's
    ``record_data``) but whose rows it cannot cut (their samples are not the arguments' rows it slices)."""
    tensors = [tensor for _path, tensor in iter_tensors((root.args, root.kwargs), attributes=True)]
    tensors += [tensor for _path, _argument, tensor in [*array_values(root.args, "input"),
                                                        *array_values(root.kwargs, "kwargs")]]
    return any(tensor.is_floating_point() and not bool(torch.isfinite(values_to_read(tensor)).all())
               for tensor in tensors)


def outside_note(report: Report, calls: Iterable[RootCall]) -> Note | None:
    """Why skip-batch was not tried at a data event whose batch no call holds as rows: ``fixes-batch-unsliced``
    where a call's numpy array or object held the values, else :func:`none_fit`'s note."""
    return Note("fixes-batch-unsliced") if any(unsliced_nonfinite(call) for call in calls) else none_fit(report)


def trained_argument(step: FailingStep) -> bool:
    """Whether a non-finite argument of the call is a tensor the loop trains (a leaf that requires gradients: a soft
    prompt stepped by hand, a learned embedding passed in): its rows are its own slots, not samples, and a step
    without some of them means nothing for where its NaN came from (the loop's update of it)."""
    root = step.root
    return any(tensor.is_leaf and tensor.requires_grad and tensor.is_floating_point()
               and not bool(torch.isfinite(values_to_read(tensor)).all())
               for _path, tensor in iter_tensors((root.args, root.kwargs)))


def sparse_nonfinite(step: FailingStep) -> bool:
    """Whether a sparse tensor the call is given (a graph's adjacency) holds the non-finite values: its rows are
    nodes joined to each other, not samples, and it has no rows to index; a step without some of them is not the
    step with fewer samples. A finite sparse tensor beside a dense batch (a fixed Laplacian) is passed whole."""
    root = step.root
    return any(tensor.layout is not torch.strided and tensor.is_floating_point()
               and not bool(torch.isfinite(values_to_read(tensor)).all())
               for _path, tensor in iter_tensors((root.args, root.kwargs)))


def without_bad_samples(step: FailingStep) -> tuple[FailingStep, tuple[int, ...], int] | None:
    """``step`` with the bad samples left out, their indices and the batch size; None where none can be."""
    root = step.root
    tensors = [tensor for _path, tensor in iter_tensors((root.args, root.kwargs))
               if tensor.dim() > 0 and tensor.layout is torch.strided]
    bad = [tensor for tensor in tensors
           if tensor.is_floating_point() and not bool(torch.isfinite(values_to_read(tensor)).all())]
    if not bad:
        return None
    size = bad[0].shape[0]
    keep = torch.ones(size, dtype=torch.bool, device=bad[0].device)
    for tensor in bad:
        if tensor.shape[0] == size:
            keep &= torch.isfinite(values_to_read(tensor).reshape(size, -1)).all(dim=1)
    dropped = tuple(int(index) for index in (~keep).nonzero().flatten().tolist())
    if not dropped or len(dropped) == size:
        return None  # nothing to leave out, or nothing would be left

    def kept(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != size or tensor.layout is not torch.strided:
            return tensor  # a sparse tensor beside the batch (a graph's Laplacian) is no samples: passed whole
        return tensor[keep.to(tensor.device)]

    args: Any = map_tensors(kept, root.args)
    kwargs: Any = map_tensors(kept, root.kwargs)
    # A gradient held for the outputs (the deferred check judges the batch after backward) loses the same rows.
    grads = {path: kept(grad) for path, grad in root.output_grads.items()}
    smaller = dataclasses.replace(root, args=args, kwargs=kwargs, output_grads=grads)
    return dataclasses.replace(step, root=smaller, rows=keep), dropped, size
