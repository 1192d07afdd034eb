"""Running statistics (BatchNorm's ``running_mean`` / ``running_var``) read with the optimizer step's gradients.

A BatchNorm in training normalises with the batch's own statistics and only
writes its running statistics, which nothing reads until ``eval()``. Inputs of
~1e20 make the batch variance pass float32's max: ``running_var`` becomes inf
while every boundary stays finite (the batch's output is its bias), and the
first evaluation normalises by inf, silently (x / inf = 0), or makes NaN.
No module output shows it, so the buffers themselves are read.

Which: the floating buffers of each module that tracks running statistics
(holds a ``num_batches_tracked`` buffer: the BatchNorm and InstanceNorm
family) inside a watched model that holds a parameter the optimizer steps;
only such a model's forward can have written them this step. When: at the
optimizer's pre-hook, as one more norm in the step's one read of its
gradients (a concatenation and a dot on the CPU, one fused norm per dtype on
a GPU; no Python per buffer). Each step reads them, so the step a buffer
turned non-finite is the step named. The slots (the owner's buffer dict and
key) are found once per optimizer layout and read as they are each step, so a
buffer replaced by ``model.to(...)`` or assigned anew is the one read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from nan_magic.distributed.ranks import data_parallel_paths, user_name, user_type
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.reads import finite_max, is_checkable, norms, read_scalars
from nan_magic.hot.stats import tensor_stats
from nan_magic.plain import to_pairs
from nan_magic.records import Cause, Phase, TensorRef, TensorRole

__all__ = ["RunningStats", "running_stats_of"]

#: Concatenates flattened tensors in one C++ call (as optim.py's gradient read does).
_flatten = torch._C._nn.flatten_dense_tensors

#: ``(qualified buffer name, owner's module name, owner, the owner's buffer dict, key)``
_Slot = tuple[str, str, nn.Module, dict[str, torch.Tensor | None], str]


class RunningStats:
    """The running-statistics buffers one optimizer's models write, read at its step."""

    def __init__(self, slots: list[_Slot]) -> None:
        self.slots = slots
        #: Reads made: every one before the last found them finite (one that did not stops the read of that buffer).
        self.reads = 0

    def norms(self) -> list[torch.Tensor]:
        """One sum over them all, not read yet: finite when each buffer is (a sum that overflows on finite values
        is measured again, buffer by buffer, in :meth:`judge`). Buffers on several devices: a sum per tensor."""
        self.reads += 1
        try:  # (subscripts, not ``get``: no Python call per buffer)
            buffers = [buffer for _name, _module, _owner, owned, key in self.slots
                       if (buffer := owned[key]) is not None]
            return [_flatten(buffers).sum()]
        except KeyError:  # a buffer deleted since: not read any more
            self.slots = [slot for slot in self.slots if slot[4] in slot[3]]
            return self.norms()
        except (RuntimeError, ValueError):  # several devices (or none left): a sum per tensor
            return norms(buffers, finiteness_only=True)

    def judge(self) -> Finding | None:
        """The read was not finite: the first non-finite buffer, as a finding of the forward that wrote it this step.

        The cold path: each buffer is measured again on its own (None: the
        sum overflowed on finite values). A reported buffer is not read again
        (under ``on_detect="warn"`` it stays inf).
        """
        for index, (name, module, owner, owned, key) in enumerate(self.slots):
            buffer = owned.get(key)
            if buffer is None or math.isfinite(read_scalars(norms([buffer], finiteness_only=True))[0]):
                continue
            del self.slots[index]
            finding = Finding(Phase.FORWARD, None, TensorRef(TensorRole.BUFFER, name), bad=buffer.detach())
            finding.module, finding.module_type = module, user_type(owner)
            finding.cause = _overflow_cause(finding, owner, key, buffer, self.reads > 1)
            return finding
        return None


def running_stats_of(roots: Iterable[tuple[str | None, nn.Module]], parameters: set[int]) -> RunningStats | None:
    """The running-statistics slots of the watched ``roots`` that hold one of ``parameters`` (ids); None if none."""
    slots: list[_Slot] = []
    for _label, root in roots:
        if not any(id(parameter) in parameters for parameter in root.parameters()):
            continue
        data_parallel = data_parallel_paths(root)
        for path, module in root.named_modules():
            owned = module._buffers
            if "num_batches_tracked" not in owned or owned["num_batches_tracked"] is None:
                continue
            name = user_name(path, data_parallel)
            slots += [(f"{name}.{key}" if name else key, name, module, owned, key)
                      for key, buffer in owned.items() if key != "num_batches_tracked" and is_checkable(buffer)]
    return RunningStats(slots) if slots else None


def _overflow_cause(finding: Finding, owner: nn.Module, key: str, buffer: torch.Tensor, read_before: bool) -> Cause:
    """What happened: the running statistic passed its dtype's max, and what that says of the inputs.

    A running variance is ``(1 - momentum) * old + momentum * var(batch)``:
    inf from a finite ``old`` means ``var(batch)`` passed the max, so the
    batch's values spread over more than ``sqrt(max)`` (1.8e19 in float32),
    a bound read from the dtype, not measured. A running mean passes it only
    with inputs near the max itself. The sibling statistics' largest finite
    magnitude is measured.
    """
    stats = tensor_stats(buffer)
    limit = finite_max(buffer.dtype)
    siblings = tuple(
        (other, float(value.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()))
        for other, value in owner._buffers.items()
        if other not in (key, "num_batches_tracked") and value is not None and is_checkable(value) and value.numel()
    )
    facts = (
        ("subject", to_pairs(finding.tensor)), ("module", finding.module), ("module_type", finding.module_type),
        ("statistic", key), ("dtype", str(buffer.dtype).removeprefix("torch.")), ("limit", limit),
        ("bound", math.sqrt(limit) if "var" in key else limit), ("momentum", getattr(owner, "momentum", None)),
        ("nan", stats.nan), ("posinf", stats.posinf), ("neginf", stats.neginf), ("numel", stats.numel),
        ("siblings", siblings), ("read_before", read_before),
    )
    return Cause("overflow", "running-stats-overflow", facts)
