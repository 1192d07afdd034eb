"""A tensor's exact numbers, read only for the tensors involved in an event (the slow path).

:func:`tensor_stats`: exact counts of each non-finite kind, stats over the
finite elements, the first bad index; :func:`probe_stats` and
:func:`finite_stats`: what is known of a tensor freed since, from its probe;
:func:`sample_values`: a bounded sample for the histogram; :func:`kinds_of`:
exact kinds, where a probe's NaN hides infinities. Every number describes what
hot/reads.py's :func:`~nan_magic.hot.reads.values_to_read` gives of a tensor
(a complex tensor's real view, a sparse tensor's stored values).
"""

from __future__ import annotations

import functools
import math

import torch

from nan_magic.hot.reads import probe_kinds, read_probe, values_to_read
from nan_magic.records import KINDS, Sample, TensorRef, TensorStats

__all__ = ["PendingCounts", "finite_stats", "infinities_beside_nan", "kinds_of", "probe_stats", "sample_values",
           "tensor_stats"]


def kinds_of(tensor: torch.Tensor) -> frozenset[str]:
    """Exact non-finite kinds of a tensor (slow path)."""
    low, high = read_probe(tensor)
    kinds = probe_kinds(low, high)
    return infinities_beside_nan(tensor) if "nan" in kinds else kinds


def infinities_beside_nan(tensor: torch.Tensor) -> frozenset[str]:
    """The kinds of a tensor holding NaN, which hides its infinities from a probe: two passes, not a whole
    :func:`tensor_stats` (a replay past the event asks it of every op output the NaN reached)."""
    with torch.no_grad():
        x = values_to_read(tensor)
        wide = x.float() if x.element_size() < 4 else x
        signs = ("+inf", bool((wide == math.inf).any())), ("-inf", bool((wide == -math.inf).any()))
    return frozenset({"nan", *(kind for kind, present in signs if present)})


def tensor_stats(tensor: torch.Tensor) -> TensorStats:
    """Exact statistics of one tensor: counts apart, stats over finite values.

    Runs under ``no_grad`` on a detached view; computes in float32 at least so
    that float16 sums do not overflow while describing an overflow.
    """
    with torch.no_grad():
        x = values_to_read(tensor)
        wide = x.float() if x.element_size() < 4 else x
        finite_mask = torch.isfinite(wide)
        first_bad: tuple[int, ...] | None = None
        nan = posinf = neginf = 0
        if bool(finite_mask.all()):
            # Most tensors a report describes are finite (its layer table's rows): no counts to take and no mask
            # to copy through, the same values in the same order (a report of a large model reads hundreds).
            finite = wide.reshape(-1)
        else:
            nan = int(torch.isnan(wide).sum())
            posinf = int((wide == math.inf).sum())
            neginf = int((wide == -math.inf).sum())
            finite = wide[finite_mask]
            # The first, by argmax (its first maximum, documented): nonzero() would list every non-finite index.
            flat_index = int((~finite_mask).reshape(-1).to(torch.uint8).argmax())
            first_bad = _unravel(flat_index, tuple(x.shape))
        low = high = mean = std = absmax = None
        zeros = negatives = 0
        if finite.numel():
            low_t, high_t = torch.aminmax(finite)
            low, high = float(low_t), float(high_t)
            as64 = finite.double()
            mean = float(as64.mean())
            std = float(as64.std(correction=0))
            absmax = max(abs(low), abs(high))
            zeros = int((finite == 0).sum())
            negatives = int((finite < 0).sum())
    return TensorStats(
        dtype=_dtype_name(tensor.dtype),
        shape=tuple(x.shape),
        numel=x.numel(),
        nan=nan,
        posinf=posinf,
        neginf=neginf,
        min=low,
        max=high,
        mean=mean,
        std=std,
        absmax=absmax,
        zeros=zeros,
        negatives=negatives,
        first_bad_index=first_bad,
    )


class PendingCounts:
    """A tensor's count of each non-finite kind, taken on its device (no read to the host, no copy) and read only
    when :meth:`stats` is asked: ops mode's deferred tracer keeps them for a boundary its check may find freed (a
    gradient into a module's output), and a step that stays silent (an absorbed NaN, a skipped AMP step) reads none.
    ``kinds``: the kinds the tensor holds, where known (the others are not counted: 0)."""

    __slots__ = ("counts", "dtype", "first", "shape")

    def __init__(self, tensor: torch.Tensor, kinds: frozenset[str] | None = None) -> None:
        with torch.no_grad():
            x = values_to_read(tensor)
            self.dtype, self.shape = _dtype_name(tensor.dtype), tuple(x.shape)
            masks = [None if kinds is not None and kind not in kinds else
                     torch.isnan(x) if kind == "nan" else x == (math.inf if kind == "+inf" else -math.inf)
                     for kind in KINDS]
            # (count_nonzero: a bool tensor's sum takes 2-3 times as long on the CPU)
            self.counts = tuple(None if mask is None else torch.count_nonzero(mask) for mask in masks)
            present = [mask for mask in masks if mask is not None]
            bad = functools.reduce(torch.logical_or, present) if present and x.numel() else None
            # The first non-finite element's flat index (argmax: its first maximum, as tensor_stats takes it).
            self.first = bad.reshape(-1).view(torch.uint8).argmax() if bad is not None else None

    def stats(self) -> TensorStats:
        """The counts and the first non-finite index, read now; the other numbers unknown (None): the tensor is gone."""
        nan, posinf, neginf = (0 if count is None else int(count) for count in self.counts)
        first = _unravel(int(self.first), self.shape) if self.first is not None and nan + posinf + neginf else None
        return TensorStats(dtype=self.dtype, shape=self.shape, numel=math.prod(self.shape), nan=nan, posinf=posinf,
                           neginf=neginf, first_bad_index=first)


def probe_stats(tensor_dtype: torch.dtype, shape: tuple[int, ...], low: float, high: float) -> TensorStats:
    """Stats of a tensor known only through its probe (it was freed since).

    Counts are ``None`` (unknown) where the probe shows that kind; ranges are
    kept only when finite.
    """
    kinds = probe_kinds(low, high)
    numel = math.prod(shape)
    unknown_or_zero = {kind: (None if kind in kinds else 0) for kind in KINDS}
    finite_range = not kinds
    return TensorStats(
        dtype=_dtype_name(tensor_dtype),
        shape=shape,
        numel=numel,
        nan=unknown_or_zero["nan"],
        posinf=unknown_or_zero["+inf"],
        neginf=unknown_or_zero["-inf"],
        min=low if finite_range else None,
        max=high if finite_range else None,
        absmax=max(abs(low), abs(high)) if finite_range else None,
    )


def finite_stats(tensor_dtype: torch.dtype, shape: tuple[int, ...]) -> TensorStats:
    """Stats of a freed tensor known to have been finite, range not measured."""
    return TensorStats(
        dtype=_dtype_name(tensor_dtype), shape=shape, numel=math.prod(shape), nan=0, posinf=0, neginf=0
    )


#: The largest-magnitude finite values every sample keeps beside its strided ones.
_EXTREMES = 16


def sample_values(
    tensor: torch.Tensor, ref: TensorRef, size: int, producer: bool = True, module: str | None = None,
    model: str | None = None,
) -> Sample:
    """A bounded, deterministic sample of the finite values of ``ref`` (of ``module``'s call), copied to the CPU.

    Strided rather than random: drawing from torch's generator would change
    the user's random stream, and the watch must not change results.
    """
    with torch.no_grad():
        flat = values_to_read(tensor).reshape(-1)
        finite = flat[torch.isfinite(flat)]
        stride = max(1, finite.numel() // size)
        picked = finite[::stride][:size]
        if finite.numel() > picked.numel():
            # A strided sample misses the rare outliers a histogram is read for (one token's
            # row of 397s among values near 1): the largest magnitudes are always in it.
            extremes = finite[finite.abs().topk(min(_EXTREMES, finite.numel())).indices]
            picked = torch.cat((picked[: size - extremes.numel()], extremes))
        values = picked.double().cpu().tolist()
        # One small tensor of the four counts, read once (one sync on CUDA).
        nan, posinf, neginf, zeros = torch.stack((
            torch.isnan(flat).sum(), torch.isposinf(flat).sum(), torch.isneginf(flat).sum(), (flat == 0).sum(),
        )).tolist()
    return Sample(
        dtype=_dtype_name(tensor.dtype), values=tuple(values), numel=flat.numel(), producer=producer,
        nan=nan, posinf=posinf, neginf=neginf, zeros=zeros, tensor=ref, module=module, model=model,
    )

def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
