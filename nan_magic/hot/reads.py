"""What the watch reads of a tensor, and the reads that say whether it is finite.

:func:`probe` is the hot path, run on every watched tensor: one fused ``torch.aminmax`` whose two scalars say whether
the tensor is finite (NaN propagates into both, ``+inf`` shows as the max, ``-inf`` as the min) and give its range for
the per-layer table. It allocates no full-size temporary, unlike ``isfinite(x).all()``. :func:`norms` reads whole
parameter sets at once; :func:`read_scalars` brings the 0-d results to the host in one transfer per device. The exact
counts and summaries of a tensor involved in an event are hot/stats.py's.

What is read of a tensor (:func:`values_to_read`): a real floating tensor's own values; a complex tensor's real view
(``torch.view_as_real``: a complex value is non-finite where its real or imaginary part is); a sparse tensor's stored
values (COO, CSR, CSC, BSR, BSC: an element it does not store is zero); a float8 tensor's values widened to float32
(torch has no float8 reductions). Statistics describe what was read, so a complex tensor's counts are *per real
component*: ``-inf+0j`` counts one -inf, ``nan+nanj`` two NaN, and its ``shape`` and ``numel`` are those of the real
view (a trailing 2); a sparse tensor's are those of its stored values. A tensor the watch cannot read
(:func:`unreadable_reason`: nested, meta, packed float4, a subclass with its own dispatch such as a fake or functional
tensor) is skipped and counted, never read: reading it would fail or run someone else's code. A ``torch.func``
transform's wrapper (grad's, vmap's) is read through the plain tensor it wraps (hot/wrapped.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nan_magic.hot.object_reads import _LEAVES, MAX_TENSORS, key_text, object_tensors, stored_items
from nan_magic.hot.wrapped import is_wrapped, unwrapped

__all__ = ["BATCHED_GRADS", "DOT_MIN_NUMEL", "WIDE_FLOATS", "GradOff", "dot_norm", "finite_max", "is_checkable",
           "is_checkable_op_value", "iter_tensors", "norms", "object_tensors", "probe", "probe_kinds", "read_batched",
           "read_probe", "read_scalars", "readable", "relevant_kinds", "transformed_call", "unread_parts",
           "unreadable_reason", "values_to_read", "version_of"]

#: torch's own tensor types: the only ones read without looking closer.
_PLAIN = (torch.Tensor, nn.Parameter)


def version_of(tensor: torch.Tensor) -> int:
    """In-place version counter; inference tensors have none (they read as 0)."""
    try:  # (no is_inference() first: one Python call less, on every record of every step)
        return tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return 0


def is_checkable(value: Any) -> bool:
    """True for a floating or complex tensor with values the watch reads (see :func:`values_to_read`).

    Dense, sparse, real or complex; not empty, and not one the watch cannot
    read (:func:`unreadable_reason`). The one definition every check uses:
    module outputs, the loss, gradients, parameters and the op tracer.
    """
    # (The hot path asks each of a step's boundary tensors: its dtype in a set, not is_floating_point and itemsize,
    # torch's two C tests bound here; attributes, not methods: shape for numel() > 0.)
    if type(value) not in _PLAIN:
        if not isinstance(value, torch.Tensor):
            return False
    elif (
        value.dtype in _READ_AS_IS  # (float8 and packed float4, one byte: asked below)
        and value.layout is _STRIDED
        and not value.is_meta
        and not value.is_nested
        and not is_wrapped(value)  # (_transformed, inlined: this is asked of every tensor checked)
        and not _is_functional(value)
    ):
        return 0 not in value.shape  # the hot path: a dense real floating tensor of torch's own type
    return (value.is_floating_point() or value.is_complex()) and unreadable_reason(value) is None and value.numel() > 0


def is_checkable_op_value(value: Any) -> bool:
    """:func:`is_checkable`, for a value the op tracer meets (``ops=True``, off the hot path): and not an
    efficient zero tensor (``aten._efficientzerotensor``, forward-mode AD's zero tangents: ``torch.func.jacfwd``,
    ``hessian``, ``jvp``). Those are zeros by construction and hold no storage; a reduction of one inside the
    tracer's ``__torch_dispatch__`` reads a null pointer (a segmentation fault, torch 2.13).
    """
    return is_checkable(value) and not value._is_zerotensor()


def unreadable_reason(value: torch.Tensor) -> str | None:
    """Why the watch cannot read a floating or complex tensor, in a word; None when it can (or it is neither).

    ``nested`` (a nested tensor has no single shape to reduce), ``meta``
    (no data), ``float4`` (packed float4 has no NaN or inf to hold, and no
    kernels to read it), ``functorch`` (a value inside ``torch.func.vmap``, ``grad``
    or ``functionalize``: a wrapper, whose values :func:`iter_tensors` reads through
    :func:`unwrapped` where it can, and never itself), or
    the class name of a subclass that overrides ``__torch_dispatch__`` (a
    fake tensor, a functional wrapper, a distributed tensor: a reduction
    would fail, have no data, or communicate). A subclass overriding only
    ``__torch_function__`` is read through a plain view of its data,
    without calling its code.
    """
    if not (value.is_floating_point() or value.is_complex()):
        return None
    if value.is_nested:
        return "nested"
    if value.is_meta:
        return "meta"
    if value.dtype in _NO_NONFINITE:
        return "float4"
    if _transformed(value):
        return "functorch"
    if type(value) not in _PLAIN and _dispatches(type(value)):
        return type(value).__name__
    return None


#: Floating dtypes with no encoding of NaN or inf (packed float4, MXFP4's elements): nothing to find, and torch has
#: neither a reduction nor a conversion for them.
_NO_NONFINITE = frozenset(dtype for dtype in (getattr(torch, "float4_e2m1fn_x2", None),) if dtype is not None)


#: Whether a tensor is functionalize's wrapper.
_is_functional = torch._is_functional_tensor
#: The floating dtypes of more than one byte: those :func:`is_checkable` finds readable as they are.
_READ_AS_IS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_STRIDED = torch.strided


class _BatchedGrads:
    """How many ``autograd.grad(..., is_grads_batched=True)`` calls are running now (patches/backward.py counts).

    Such a call runs its backward under torch's legacy vmap: every gradient a hook receives is a legacy batched
    tensor, which neither test above tells from a plain one and which no reduction can read to the host there
    ("Batching rule not implemented for aten::detach"). A Jacobian's rows, not a training step's gradients: the
    hooks step aside while the count is not 0. Not thread-local: a CUDA backward runs its hooks on autograd's
    device thread, not the caller's. An attribute, read with no call (the gradient hooks ask it every step).
    """

    running = 0


BATCHED_GRADS = _BatchedGrads()


def _transformed(value: torch.Tensor) -> bool:
    """A value of a ``torch.func`` transform in progress (one C call each: this is on the hot path)."""
    return is_wrapped(value) or torch._is_functional_tensor(value)


@functools.cache
def _dispatches(kind: type) -> bool:
    """Whether a tensor subclass intercepts torch's operators (``__torch_dispatch__``)."""
    return getattr(kind, "__torch_dispatch__", None) is not getattr(torch.Tensor, "__torch_dispatch__", None)


def values_to_read(tensor: torch.Tensor) -> torch.Tensor:
    """The dense real floating tensor whose values stand for ``tensor``'s (see the module notes).

    Detached; a view where one exists (no copy for a dense complex or a
    sparse tensor). Only for a tensor :func:`is_checkable` accepts.
    """
    if type(tensor) not in _PLAIN:
        # A __torch_function__ subclass: its data, without its code (detach too would call it).
        with torch._C.DisableTorchFunctionSubclass():
            tensor = tensor.as_subclass(torch.Tensor)
    tensor = tensor.detach()
    if tensor.layout is torch.sparse_coo:
        tensor = tensor._values()  # stored values, coalesced or not: a duplicate's own value counts
    elif tensor.layout is not torch.strided:
        tensor = tensor.values()  # CSR, CSC, BSR, BSC
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor.resolve_conj())
    elif tensor.itemsize == 1 and tensor.dtype.is_floating_point:
        # float8 (simulated fp8 training, an fp8 cast's output): no reduction kernels; float32 holds each of its
        # values exactly, NaN and inf included (a copy, 4x its size: such tensors are rare at a boundary).
        tensor = tensor.float()
    return tensor


def readable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it is already what :func:`values_to_read` gives (the hot path)."""
    if (type(tensor) is torch.Tensor and tensor.layout is torch.strided and not tensor.dtype.is_complex
            and tensor.itemsize != 1):
        return tensor
    return values_to_read(tensor)


#: From this many elements on, a CPU probe is ``amin`` then ``amax`` (see :func:`probe`)...
_SPLIT_PROBE_NUMEL = 1 << 19
#: ...up to this many bytes, beyond which two passes over memory cost more than one.
_SPLIT_PROBE_MAX_BYTES = 8 << 20


def probe(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` as 0-d tensors on the tensor's device; both NaN if any element is.

    ``tensor`` is a dense real one (:func:`readable` gives that of any
    checkable tensor; the callers convert once, as they record).

    One fused ``aminmax`` on a GPU (one kernel) and for most CPU tensors.
    On the CPU, ``aminmax`` runs a scalar loop, while ``amin`` and ``amax``
    each run a vectorised one: for a tensor of half a million to two
    million floats, still in cache when its module returns, the two passes
    take 10-20% less time (torch 2.13, 2 cores, a fresh matmul output: 35
    vs 42 us for 512K floats, 74 vs 85 us for 1M). Below that the second
    call's fixed cost wins; above it the tensor comes from memory, read
    twice (606 vs 359 us for 4M floats). ``amin``/``amax`` propagate NaN
    like ``aminmax``. No host synchronisation happens here; the caller
    decides when to read.
    """
    tensor = tensor.detach()
    if tensor.is_cpu and _SPLIT_PROBE_NUMEL * tensor.itemsize <= tensor.nbytes < _SPLIT_PROBE_MAX_BYTES:
        return torch.amin(tensor), torch.amax(tensor)
    return torch.aminmax(tensor)


#: Float dtypes of 32 bits or more: where sums and dots do not overflow at ordinary magnitudes.
WIDE_FLOATS = (torch.float32, torch.float64)

#: Below this many elements one fused ``_foreach_norm`` call beats a call per tensor.
DOT_MIN_NUMEL = 1 << 15


class GradOff:
    """``torch.no_grad()`` for the hot path: ``with GradOff():`` is two Python calls and torch's two C calls,
    where ``no_grad``'s construction, ``__enter__`` and ``__exit__`` run a dozen (the optimizer's gradient read and
    the buffer copies use it every step)."""

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = torch.is_grad_enabled()
        if self._was:
            torch._C._set_grad_enabled(False)

    def __exit__(self, *_exc: object) -> None:
        if self._was:
            torch._C._set_grad_enabled(True)


def norms(tensors: list[torch.Tensor], *, finiteness_only: bool = False) -> list[torch.Tensor]:
    """2-norms of many tensors as 0-d device tensors, in order; no host sync.

    The cheapest finiteness test for whole parameter sets (NaN and inf
    propagate into the norm). A norm can also overflow for huge finite
    values; callers confirm with :func:`kinds_of` before reporting, so that
    costs time, never truth.

    On a GPU, one fused ``_foreach_norm`` per (device, dtype) group (one
    launch). On the CPU a large contiguous float32/float64 tensor gets
    ``sqrt(dot(x, x))`` instead: the BLAS dot takes about half the time of
    ``_foreach_norm`` on the benchmark models' weights; small tensors still
    share one ``_foreach_norm``. With ``finiteness_only`` (no norm wanted)
    such a tensor gets its plain sum, a little faster still: a sum is
    non-finite exactly when the tensor is, or when huge finite values
    overflow it (confirmed as above).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    result: list[torch.Tensor | None] = [None] * len(tensors)
    readable = tensors
    # The small tensors' (device, dtype), while they all share one: grouped only where they do not (no Python
    # call per tensor for the usual parameter set, a few dozen of one dtype on one device).
    shared: tuple[torch.device, torch.dtype] | None = None
    mixed = False
    for index, tensor in enumerate(tensors):
        if tensor.layout is not torch.strided:  # a sparse gradient (an Embedding's): its stored values
            readable = list(tensors) if readable is tensors else readable
            tensor = readable[index] = values_to_read(tensor)
        if (tensor.is_cpu and tensor.dtype in WIDE_FLOATS and tensor.nbytes >= DOT_MIN_NUMEL * tensor.itemsize
                and tensor.is_contiguous()):
            result[index] = _flat(tensor).sum() if finiteness_only else dot_norm(tensor)
        elif shared is None:
            shared = (tensor.device, tensor.dtype)
        elif not mixed and (tensor.dtype is not shared[1] or tensor.device != shared[0]):
            mixed = True
    if shared is not None:
        small = [index for index, norm in enumerate(result) if norm is None]
        if not mixed:
            groups[shared] = small
        else:
            for index in small:
                tensor = readable[index]
                groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    if groups:
        # One no_grad for the small tensors: cheaper than detaching each of them.
        with GradOff():
            for indices in groups.values():
                for index, norm in zip(indices, torch._foreach_norm([readable[i] for i in indices], 2)):
                    result[index] = norm
    return result  # type: ignore[return-value]  # (every index set above)


def dot_norm(tensor: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a contiguous CPU float32/float64 tensor by a BLAS dot (see :func:`norms`)."""
    flat = _flat(tensor)
    return torch.dot(flat, flat).sqrt_()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    # Only a tensor that requires grad (a gradient of create_graph=True) is
    # detached: the others record no graph, at no cost.
    return (tensor.detach() if tensor.requires_grad else tensor).view(-1)


@functools.cache
def finite_max(dtype: torch.dtype) -> float:
    """The largest finite value of a floating dtype (cached: ``torch.finfo`` takes microseconds)."""
    return torch.finfo(dtype).max


def read_scalars(scalars: list[torch.Tensor]) -> list[float]:
    """Copy many 0-d device tensors to Python floats: one transfer per device."""
    for scalar in scalars:  # (a loop, not all() over a generator: each of its items is a Python call)
        if not scalar.is_cpu:
            return read_batched(scalars)
    # No transfer to batch: one read each is cheaper than a stack (float(), not .item(): no Python call each).
    return [float(scalar) for scalar in scalars]


def read_batched(scalars: list[torch.Tensor]) -> list[float]:
    """:func:`read_scalars` as one stacked copy per device (what a GPU gets).

    Stacked per dtype first, then converted to float32 once per dtype (not
    once per scalar: a bfloat16 optimizer's state would otherwise cost a
    kernel launch per tensor), then copied in one transfer per device.
    """
    groups: dict[torch.device, dict[torch.dtype, list[int]]] = {}
    for index, scalar in enumerate(scalars):
        groups.setdefault(scalar.device, {}).setdefault(scalar.dtype, []).append(index)
    values = [math.nan] * len(scalars)
    for by_dtype in groups.values():
        order = [index for indices in by_dtype.values() for index in indices]
        parts = [torch.stack([scalars[i] for i in indices]).float() for indices in by_dtype.values()]
        for index, value in zip(order, torch.cat(parts).tolist()):
            values[index] = value
    return values


def probe_kinds(low: float, high: float) -> frozenset[str]:
    """Non-finite kinds visible from a probe's ``(min, max)``.

    NaN hides infinities (both read NaN), so a NaN probe reports ``{"nan"}``
    only; :func:`tensor_stats` gives exact counts when it matters.
    """
    if math.isnan(low) or math.isnan(high):
        return frozenset({"nan"})
    kinds = set()
    if high == math.inf:
        kinds.add("+inf")
    if low == -math.inf:
        kinds.add("-inf")
    return frozenset(kinds)


def relevant_kinds(kinds: frozenset[str], watched: frozenset[str]) -> frozenset[str]:
    """Restrict kinds to what the watch counts (``"inf"`` covers both signs)."""
    if not kinds:
        return kinds  # the hot path: a finite tensor
    keep = {"nan"} if "nan" in watched else set()
    if "inf" in watched:
        keep |= {"+inf", "-inf"}
    return kinds & keep


def read_probe(tensor: torch.Tensor) -> tuple[float, float]:
    """``(min, max)`` of a checkable tensor as floats, read in one transfer (slow path)."""
    low, high = read_scalars(list(probe(readable(tensor))))
    return low, high


def iter_tensors(
    value: Any, path: str = "", skipped: Counter[str] | None = None, *, attributes: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every checkable tensor in a nested value.

    Handles tensors, tuples/lists, mappings (including Hugging Face ``ModelOutput``, an ordered dict), dataclasses
    and ``torch.distributions`` objects (their parameters). Containers are read as stored, never through their own
    code (a mapping's ``__getitem__``, a list subclass's ``__iter__``, a key's ``__repr__``: object_reads.py). Paths
    read like Python: ``[1]``, ``['logits']``, ``.hidden``. Runs in every hook, so a bare tensor and a flat tuple of
    tensors take a fast path; depth is bounded so that odd self-referencing containers cannot hang a hook. A
    floating tensor the watch cannot read is left out and, given ``skipped``, counted there under its
    :func:`unreadable_reason`.

    With ``attributes`` (a module's return value, never its arguments) a plain object's own tensor attributes, the
    mappings it keeps them in and the objects holding tensors of their own, are read too (:func:`object_tensors`): a
    detector's result object (detectron2's ``Instances``, a user's class). Arguments are walked without: a cache
    object passed to every call would be read at every call; only the batch entering a model (once per top-level
    call) is walked with them, as a graph library's ``Data`` object.
    """
    if type(value) is torch.Tensor:  # the common case: one output
        if is_checkable(value):
            return [(path, value)]
        if skipped is not None and (inner := _count_unreadable(value, skipped)) is not None:
            return [(path, inner)]
        return []
    found: list[tuple[str, torch.Tensor]] = []
    _collect(value, path, 0, found, skipped, [MAX_TENSORS] if attributes else None)
    return found


def transformed_call(args: Any, kwargs: Any) -> bool:
    """Whether a call's arguments hold a ``torch.func`` transform's wrapper (a call made inside ``vmap``): such a
    call cannot be replayed once the transform has returned. Off the hot path: asked at a replay only."""
    return any(isinstance(t, torch.Tensor) and _transformed(t) for t in torch.utils._pytree.tree_leaves((args, kwargs)))


def unread_parts(output: Any) -> tuple[str, ...]:
    """Why a module's return value, of which :func:`iter_tensors` read nothing, held floating values unread.

    The :func:`unreadable_reason` of each floating tensor left out (``functorch``: inside ``functionalize``), and
    ``object <class>`` for a return value that is an object whose tensors, if any, are not its own attributes
    (``__slots__``, a list of tensors). Empty for a value with nothing floating to read (an integer tensor). Off the
    hot path: asked only of a call whose output gave no record."""
    skipped: Counter[str] = Counter()
    iter_tensors(output, "", skipped, attributes=True)
    reasons = list(skipped)
    if not reasons and not isinstance(output, (torch.Tensor, Mapping, tuple, list, *_LEAVES)) and not (
            dataclasses.is_dataclass(output) or isinstance(output, torch.distributions.Distribution)):
        reasons.append(f"object {type(output).__name__}")
    return tuple(reasons)


def _count_unreadable(tensor: torch.Tensor, skipped: Counter[str] | None) -> torch.Tensor | None:
    """Count a tensor the watch cannot read under its reason; but a ``torch.func`` wrapper's plain tensor (wrapped.py),
    where it can be read, is returned instead, to be read in the wrapper's place."""
    reason = unreadable_reason(tensor) if skipped is not None else None
    if reason == "functorch" and (inner := unwrapped(tensor)) is not None:
        if is_checkable(inner):
            return inner
        reason = unreadable_reason(inner)  # (the plain tensor's own: an empty one has none, as unwrapped)
    if reason is not None:
        skipped[reason] += 1  # type: ignore[index]
    return None




def _collect(
    value: Any,
    path: str,
    depth: int,
    found: list[tuple[str, torch.Tensor]],
    skipped: Counter[str] | None,
    attributes: list[int] | None = None,
) -> None:
    # ``attributes``: the tensors objects' reads may still take in this walk (a list, shared down it), or None
    if isinstance(value, torch.Tensor):
        if is_checkable(value):
            found.append((path, value))
        elif (inner := _count_unreadable(value, skipped)) is not None:
            found.append((path, inner))
    elif type(value) is tuple or type(value) is list:
        for index, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                if is_checkable(item):
                    found.append((f"{path}[{index}]", item))
                elif (inner := _count_unreadable(item, skipped)) is not None:
                    found.append((f"{path}[{index}]", inner))
            elif not isinstance(item, _LEAVES) and depth < 6:
                _collect(item, f"{path}[{index}]", depth + 1, found, skipped, attributes)
    elif isinstance(value, _LEAVES) or depth >= 6:
        return
    elif isinstance(value, Mapping):
        # (Its items as stored, by dict.items: a mapping's own items(), __getitem__ and key reprs are its code, which a
        # hook never runs: object_reads.stored_items. A Hugging Face ModelOutput is a dict.)
        if (stored := value if isinstance(value, dict) else stored_items(value)) is not None:
            for key, item in dict.items(stored):
                _collect(item, f"{path}[{key!r}]" if type(key) is str else f"{path}[{key_text(key)}]", depth + 1,
                         found, skipped, attributes)
    elif isinstance(value, (tuple, list)):  # namedtuples and other subclasses (their items as stored: no __iter__)
        for index, item in enumerate(tuple.__iter__(value) if isinstance(value, tuple) else list.__iter__(value)):
            _collect(item, f"{path}[{index}]", depth + 1, found, skipped, attributes)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for item_field in dataclasses.fields(value):
            _collect(getattr(value, item_field.name, None), f"{path}.{item_field.name}", depth + 1, found, skipped,
                     attributes)
    elif isinstance(value, torch.distributions.Distribution):
        # A policy or a probabilistic head returning ``Normal(mu, log_std.exp())`` itself: its parameters are the
        # output (loc, scale, logits; a mixture's component distributions), as the tensors it was made from.
        for name, item in vars(value).items():
            if isinstance(item, (torch.Tensor, torch.distributions.Distribution)):
                _collect(item, f"{path}.{name}", depth + 1, found, skipped)
    elif attributes and attributes[0] > 0 and (held := object_tensors(value, attributes[0])):
        attributes[0] -= len(held)  # (a list of 1000 objects: 64 tensors read of them in all, every step)
        for name, tensor in held:
            _collect(tensor, f"{path}{name}", depth + 1, found, skipped)
