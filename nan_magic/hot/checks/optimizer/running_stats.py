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
gradients (one concatenation and one sum; no Python per buffer). Each step
reads them, so the step a buffer turned non-finite is the step named. The
slots (the owner's buffer dict and key) are found once per optimizer layout
and read as they are each step, so a buffer replaced by ``model.to(...)`` or
assigned anew is the one read.

The other floating buffers of those models (a user's running average, an EMA
of a loss scale) are read too where a forward writes them: their version
counters are compared during the first :data:`LEARN_READS` reads (Python per
buffer, those steps only), and one that moved joins the read. A buffer no
forward writes (a causal mask, a positional table) is never read; one first
written after those steps is not either.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from nan_magic.distributed.ranks import data_parallel_paths, user_name, user_type
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.reads import finite_max, is_checkable, norms
from nan_magic.hot.stats import tensor_stats
from nan_magic.plain import to_pairs
from nan_magic.records import Cause, Phase, TensorRef, TensorRole

__all__ = ["RunningStats", "running_stats_of"]

#: Concatenates flattened tensors in one C++ call (as step_checks.py's gradient read does).
_flatten = torch._C._nn.flatten_dense_tensors

#: Reads during which the other floating buffers' versions are watched for a forward's writes (RunningStats._learn).
LEARN_READS = 3

#: ``(qualified buffer name, owner's module name, owner, the owner's buffer dict, key)``
_Slot = tuple[str, str, nn.Module, dict[str, torch.Tensor | None], str]


class RunningStats:
    """The running-statistics buffers one optimizer's models write, read at its step."""

    def __init__(self, slots: list[_Slot], candidates: list[tuple[_Slot, int]],
                 models: dict[int, str | None] | None = None) -> None:
        self.slots = slots
        #: The label of the watched model that holds each owner (by ``id``): two models of one class, a GAN's G and
        #: D, both have a ``1.running_var``, and a report must say whose. Read at an event only.
        self.models = models or {}
        #: Reads made: every one before the last found them finite (one that did not stops the read of that buffer).
        self.reads = 0
        #: The other floating buffers, with their version when the layout was built: one whose version a forward
        #: moves within the first :data:`LEARN_READS` reads is read from then on (a user's running average).
        self.candidates: list[tuple[_Slot, int]] | None = candidates or None
        self.learned: set[int] = set()  # (ids of the slots learned so: their cause is a buffer's, not BatchNorm's)

    def norms(self) -> list[torch.Tensor]:
        """One sum over them all, not read yet: finite when each buffer is (a sum that overflows on finite values
        is measured again, buffer by buffer, in :meth:`judge`). Buffers on several devices: a sum per tensor."""
        self.reads += 1
        if self.candidates is not None:
            self._learn()
        if not self.slots:
            return []
        try:  # (subscripts, not ``get``: no Python call per buffer)
            buffers = [buffer for _name, _module, _owner, owned, key in self.slots
                       if (buffer := owned[key]) is not None]
            return [_flatten(buffers).sum()]
        except KeyError:  # a buffer deleted since: not read any more
            self.slots = [slot for slot in self.slots if slot[4] in slot[3]]
            return self.norms()
        except (RuntimeError, ValueError):  # several devices (or none left): a sum per tensor
            return norms(buffers, finiteness_only=True)

    def _learn(self) -> None:
        """Promote the candidates a forward wrote since the layout was built (their version moved); after
        :data:`LEARN_READS` reads, stop looking (a constant buffer, a causal mask, is never read)."""
        moved = []
        for slot, version in self.candidates or ():
            buffer = slot[3].get(slot[4])
            try:
                if buffer is not None and buffer._version != version:
                    moved.append(slot)
            except RuntimeError:  # an inference tensor has no version
                continue
        if moved:
            self.slots += moved
            self.learned.update(map(id, moved))
            self.candidates = [entry for entry in self.candidates or () if not any(entry[0] is m for m in moved)]
        if self.reads >= LEARN_READS or not self.candidates:
            self.candidates = None

    def judge(self) -> Finding | None:
        """The read was not finite: the first non-finite buffer, as a finding of the forward that wrote it this step.

        The cold path: each buffer is measured again on its own (None: the
        sum overflowed on finite values). A reported buffer is not read again
        (under ``on_detect="warn"`` it stays inf).
        """
        for index, (name, module, owner, owned, key) in enumerate(self.slots):
            buffer = owned[key] if key in owned else None  # noqa: SIM401 (a scripted module's buffers have no get)
            # Elementwise: a buffer's own sum overflows on finite values too (4 x 1e38), as the read's did.
            if buffer is None or bool(torch.isfinite(buffer).all()):
                continue
            slot = self.slots.pop(index)
            finding = Finding(Phase.FORWARD, None, TensorRef(TensorRole.BUFFER, name), bad=buffer.detach())
            finding.module, finding.module_type = module, user_type(owner)
            finding.model = self.models.get(id(owner))
            finding.cause = _overflow_cause(finding, owner, key, buffer, self.reads > 1, id(slot) in self.learned)
            return finding
        return None


def running_stats_of(roots: Iterable[tuple[str | None, nn.Module]], parameters: set[int],
                     versions: dict[int, int]) -> RunningStats | None:
    """The running-statistics slots of the watched ``roots`` that hold one of ``parameters`` (ids); None if none.

    ``versions``: the buffers' version counters when their root joined the watch (Targets.buffer_versions); a
    candidate's writes are counted from there, so the first layout, built at the first optimizer step, learns
    the buffers that step's forward wrote at once."""
    slots: list[_Slot] = []
    candidates: list[tuple[_Slot, int]] = []
    models: dict[int, str | None] = {}
    for label, root in roots:
        if not any(id(parameter) in parameters for parameter in root.parameters()):
            continue
        data_parallel = data_parallel_paths(root)
        for path, module in root.named_modules():
            owned = module._buffers
            running = "num_batches_tracked" in owned and owned["num_batches_tracked"] is not None
            name = user_name(path, data_parallel)
            for key, buffer in owned.items():
                if key == "num_batches_tracked" or not is_checkable(buffer) or buffer is None:
                    continue
                slot = (f"{name}.{key}" if name else key, name, module, owned, key)
                models.setdefault(id(module), label)
                if running:
                    slots.append(slot)
                elif not buffer.is_inference():
                    candidates.append((slot, versions.get(id(buffer), buffer._version)))
    return RunningStats(slots, candidates, models) if slots or candidates else None


def _overflow_cause(finding: Finding, owner: nn.Module, key: str, buffer: torch.Tensor, read_before: bool,
                    learned: bool) -> Cause:
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
    return Cause("overflow", "buffer-overflow" if learned else "running-stats-overflow", facts)
