"""Which non-finite kinds an op's tensors hold, read as cheaply as the op tracer can.

The op tracer (:mod:`nan_magic.localize.ops.tracer`) checks a checked op's outputs with
one sum each, read together (a finite sum proves a tensor finite), and reads
exact kinds only for an output that failed that check and for its inputs.
:class:`KnownKinds` remembers what it read, by tensor identity and version
counter, so that a tensor is not looked at twice. An in-place op destroys the
value it reads: :func:`probe_priors` probes it before the op (:class:`Prior`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nan_magic.hot.reads import is_checkable, is_checkable_op_value, probe, probe_kinds, readable
from nan_magic.hot.stats import infinities_beside_nan, probe_stats
from nan_magic.localize.ops.origins import Benign, Origin, Origins, dense
from nan_magic.localize.ops.plans import Plan, tensors
from nan_magic.records import KINDS, TensorStats

__all__ = ["KnownKinds", "Prior", "probe_priors", "scalar_kinds"]

#: Entries the table holds before its first sweep for freed tensors.
_FIRST_SWEEP = 1024


class KnownKinds:
    """The kinds of the tensors already looked at, kept while each is alive and unchanged."""

    def __init__(self) -> None:
        # id(tensor) -> (weak reference, version counter, kinds) of tensors whose
        # kinds are known; the reference and version make stale ids harmless.
        self._known: dict[int, tuple[weakref.ref[torch.Tensor], int, frozenset[str]]] = {}
        # Entries of freed tensors (never returned by get) are dropped each time the table doubles past what was
        # alive at the last sweep: a traced loop frees its step's tensors, and with a fixed bound of 100,000 the
        # table grew by ~7 entries a step until then (a tiny model over 2,000 steps: 13,000 dead entries).
        self._sweep_at = _FIRST_SWEEP

    def clear(self) -> None:
        """Forget every tensor (they may have changed outside the trace)."""
        self._known.clear()

    def forget(self, tensor: torch.Tensor) -> None:
        """Forget one tensor (an op wrote it, and its version counter has not moved yet)."""
        self._known.pop(id(tensor), None)

    def get(self, tensor: torch.Tensor) -> frozenset[str] | None:
        """The kinds remembered for ``tensor`` as it is now, or None."""
        entry = self._known.get(id(tensor))
        if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
            return entry[2]
        return None

    def remember(self, tensor: torch.Tensor, kinds: frozenset[str]) -> None:
        """Remember ``tensor``'s kinds for its current version."""
        if tensor.is_inference():
            return  # no version counter: a later in-place change would go unseen
        known = self._known
        known[id(tensor)] = (weakref.ref(tensor), tensor._version, kinds)
        if len(known) > self._sweep_at:
            for key in [key for key, entry in known.items() if entry[0]() is None]:
                del known[key]
            self._sweep_at = max(_FIRST_SWEEP, 2 * len(known))  # each sweep paid for by as many entries added

    def suspects(self, outputs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The outputs that may be non-finite; the others are remembered as finite."""
        checked = [(label, t) for label, t in outputs if is_checkable_op_value(t)]
        if not checked:
            return []
        suspects = []
        for (label, tensor), total in zip(checked, _read([_sum(t) for _, t in checked])):
            if math.isfinite(total):
                self.remember(tensor, frozenset())
            else:
                suspects.append((label, tensor))
        return suspects

    def kinds(self, tensor: torch.Tensor) -> frozenset[str]:
        """Exact kinds of a live tensor, from the cache where possible."""
        known = self.get(tensor)
        if known is None:
            # A complex value is non-finite where its real or imaginary part is (reads.values_to_read).
            known = _exact_kinds(tensor) if is_checkable_op_value(tensor) else frozenset()
            self.remember(tensor, known)
        return known


def scalar_kinds(value: Any) -> frozenset[str]:
    """The non-finite kind of a scalar argument, if any."""
    if not isinstance(value, float) or math.isfinite(value):
        return frozenset()
    if math.isnan(value):
        return frozenset({"nan"})
    return frozenset({"+inf" if value > 0 else "-inf"})


@dataclass(frozen=True)
class Prior:
    """What was known of a tensor's value before an in-place op wrote it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    known: frozenset[str] | None
    probed: tuple[torch.Tensor, torch.Tensor] | None
    origin: Origin | Benign | None = None

    def kinds(self) -> frozenset[str]:
        """The kinds the value held, as far as they can be told now."""
        if self.known is not None:
            return self.known
        assert self.probed is not None
        low, high = (float(v) for v in self.probed)
        kinds = probe_kinds(low, high)
        # NaN hides infinities, and the value is gone: assume it held them
        # too, so that an op is never blamed for a kind it may have passed on.
        return kinds | {"+inf", "-inf"} if "nan" in kinds else kinds

    def stats(self) -> TensorStats:
        """Statistics of the value, from its probe (counts of a present kind are None)."""
        if self.probed is not None:
            low, high = (float(v) for v in self.probed)
            return probe_stats(self.dtype, self.shape, low, high)
        counts = {kind: (None if kind in (self.known or ()) else 0) for kind in KINDS}
        return TensorStats(
            dtype=str(self.dtype).removeprefix("torch."),
            shape=self.shape,
            numel=math.prod(self.shape),
            nan=counts["nan"],
            posinf=counts["+inf"],
            neginf=counts["-inf"],
        )


def probe_priors(
    plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], known: KnownKinds, origins: Origins
) -> dict[int, Prior]:
    """Probe, before the op, every input whose value the op overwrites.

    That is the written tensor of an in-place op, and any input sharing
    its storage (``torch.add(a, b, out=a)``). A probe is an ``aminmax``
    whose result is read only if the output turns out non-finite; a
    tensor whose kinds are known costs nothing.
    """
    if plan.overwrites:
        return {}
    # Only dense tensors have a storage to compare (a sparse one's values are its own).
    written = [t for _, t in tensors(plan, args, kwargs, plan.writes) if is_checkable(t) and dense(t)]
    storages = {t.untyped_storage().data_ptr() for t in written}
    priors: dict[int, Prior] = {}
    for _, tensor in tensors(plan, args, kwargs, plan.reads):
        if is_checkable(tensor) and dense(tensor) and tensor.untyped_storage().data_ptr() in storages:
            kinds = known.get(tensor)
            probed = probe(_wide(readable(tensor))) if kinds is None else None
            origin = origins.entry(tensor) if origins else None
            priors[id(tensor)] = Prior(tensor.dtype, tuple(tensor.shape), kinds, probed, origin)
    return priors


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    # Reductions have no float8 kernels; widening keeps nan and inf.
    return tensor.float() if tensor.element_size() == 1 else tensor


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    """The cheapest check that a tensor is finite: a finite sum proves it.

    NaN and infinities propagate into a sum (``inf - inf`` is NaN). A finite
    tensor whose sum overflows is a false alarm that the exact check after it
    clears; accumulating half precision in float32 makes that all but
    impossible. On CPU a float32 sum costs a fifth of ``torch.aminmax``
    (1M elements: 43 us against 229 us, one thread); on a GPU both are bound
    by memory bandwidth.
    """
    tensor = readable(tensor)
    if tensor.element_size() < 4:
        return torch.sum(_wide(tensor), dtype=torch.float32)
    return torch.sum(tensor)


def _exact_kinds(tensor: torch.Tensor) -> frozenset[str]:
    low, high = _read(list(probe(_wide(readable(tensor)))))
    kinds = probe_kinds(low, high)
    # NaN hides infinities from a probe; looked for apart.
    return infinities_beside_nan(tensor) if "nan" in kinds else kinds


def _read(ends: list[torch.Tensor]) -> list[float]:
    """Read 0-d tensors to the host with one synchronisation."""
    if ends[0].device.type == "cpu":
        # No synchronisation to save; stacking would cost more than reading.
        return [end.item() for end in ends]
    if any(end.dtype != ends[0].dtype for end in ends):
        ends = [end.float() for end in ends]
    return torch.stack(ends).tolist()
