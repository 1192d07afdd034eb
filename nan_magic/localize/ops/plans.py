"""What an aten op does, read from its schema once per overload, and its arguments.

The op tracer (:mod:`nan_magic.localize.ops.tracer`) runs for every op, so everything
it needs to know about an op that does not depend on the values is computed
once per overload and cached (:func:`plan_of`): which arguments it reads and
writes, whether it is *passive* (cannot make a non-finite value from finite
inputs, so it goes unchecked), whether it is a dtype conversion that may
overflow, whether it returns a view. The helpers here pair an op's positional
and keyword arguments with their schema names and pick out the tensors and
numeric scalars among them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "Plan",
    "arguments",
    "flatten",
    "is_number",
    "is_wrapped_number",
    "list_positions",
    "literal_numbers",
    "narrows",
    "odd_scalar",
    "op_inputs",
    "op_name",
    "plan_of",
    "run_op",
    "run_rewrapped",
    "tensors",
]

# Ops that cannot hold a non-finite kind in their output that is absent from
# their inputs and scalar arguments: allocation of uninitialised memory, views,
# copies without a dtype change, data movement, selections, clamps, sign-like
# and bounded elementwise functions, scalar fills, bounded random draws,
# comparisons and shape queries. An entry is an overload packet ("view") or
# one overload ("scatter.src"). An op missing here is checked: when in doubt,
# check, since a passive op's new non-finite value would be blamed on no one.
_PASSIVE = frozenset(
    {
        # allocation of uninitialised memory
        "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
        "resize_", "resize_as_",
        # views, metadata and copies in the same dtype
        "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "permute", "transpose", "t",
        "squeeze", "unsqueeze", "slice", "select", "narrow", "as_strided", "split",
        "split_with_sizes", "unbind", "chunk", "alias", "detach", "diagonal", "unfold", "view_as",
        "lift_fresh", "lift_fresh_copy", "_conj", "conj", "resolve_conj", "resolve_neg",
        "_neg_view", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_", "view_as_real",
        "view_as_complex", "contiguous", "clone", "set_", "_local_scalar_dense", "expand_copy",
        "permute_copy", "view_copy", "select_copy", "slice_copy", "t_copy", "transpose_copy",
        "unsqueeze_copy", "squeeze_copy", "detach_copy", "alias_copy", "split_copy", "unbind_copy",
        # data movement: every output value is an input value or a scalar argument
        "cat", "stack", "index", "index_select", "gather", "take", "masked_select", "masked_fill",
        "masked_scatter", "where", "scatter.src", "scatter.value", "scatter_.src", "scatter_.value",
        "index_copy", "index_fill", "repeat", "roll", "flip", "constant_pad_nd", "reflection_pad1d",
        "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d",
        "replication_pad3d", "tril", "triu", "diag_embed", "select_scatter", "slice_scatter",
        "diagonal_scatter", "as_strided_scatter", "embedding", "pixel_shuffle", "pixel_unshuffle",
        "channel_shuffle", "_unsafe_index", "upsample_nearest1d", "upsample_nearest2d",
        "upsample_nearest3d",
        # fills from a scalar, and random draws that are bounded
        "fill", "fill_", "zero_", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
        "new_zeros", "new_ones", "new_full", "scalar_tensor", "eye", "_foreach_zero_", "bernoulli",
        "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randperm",
        # selections and bounded elementwise functions
        "relu", "relu_", "hardtanh", "hardtanh_", "threshold", "threshold_", "threshold_backward",
        "hardtanh_backward", "abs", "abs_", "neg", "neg_", "sign", "sgn", "floor", "ceil",
        "round.default", "trunc", "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max",
        "clamp_max_", "maximum", "minimum", "fmax", "fmin", "max", "min", "amax", "amin", "aminmax",
        "sort", "topk", "kthvalue", "median", "nanmedian", "mode", "cummax", "cummin", "argmax",
        "argmin", "argsort", "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
        "max_pool3d_with_indices", "adaptive_max_pool2d", "adaptive_max_pool3d", "sigmoid",
        "sigmoid_", "tanh", "tanh_", "sigmoid_backward", "tanh_backward",
        # comparisons and shape queries
        "eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "isposinf", "isneginf",
        "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or",
        "bitwise_not", "nonzero", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
        "is_same_size",
    }
)

# Passive ops that pick elements by an index tensor.
_PICKS = frozenset({"gather", "index", "_unsafe_index", "index_select", "take"})
# Reductions to a row's max or min (not the elementwise ``max.other``): over a fully masked row, the mask's infinity.
_MAXES = frozenset({"amax", "amin", "max", "min"})

# Copies that are passive unless they narrow the dtype (float32 -> float16
# overflows to inf); value: the argument holding the source.
_CONVERSIONS = {
    "copy_": "src",
    "copy": "src",
    "_to_copy": "self",
    "_copy_from": "self",
    "_copy_from_and_resize": "self",
}

# The ops Python's tensor literals reach the dispatcher through (torch.tensor, a number assigned by indexing).
_LITERALS = frozenset({"lift_fresh", "lift_fresh_copy"})
# In-place ops that overwrite their target without reading it. (``fill_`` and ``zero_`` too: the target of
# ``torch.empty(n).fill_(nan)`` holds whatever the allocator left, at times a NaN's bits, which is no input.)
_OVERWRITES = frozenset(
    {"copy_", "_copy_from", "_copy_from_and_resize", "normal_", "uniform_", "log_normal_",
     "exponential_", "geometric_", "cauchy_", "random_", "_foreach_copy_", "fill_", "zero_", "_foreach_zero_"}
)


@dataclass(frozen=True)
class Plan:
    """What an op overload does, from its schema alone."""

    names: tuple[str, ...]  # schema argument names, in order
    passive: bool
    conversion: str | None  # argument holding the source of a dtype conversion
    overwrites: bool
    writes: frozenset[str]  # arguments the op writes
    reads: frozenset[str]  # arguments the op reads
    # Arguments that may hold a numeric value: float, Scalar, and Tensor (a
    # Python number passed for a tensor reaches the mode as that number).
    # Not int or bool: sizes, dims and flags.
    numbers: frozenset[str]
    per_index: bool  # foreach/fused: element i of the outputs depends on element i of the inputs
    # Scalar (non-tensor) numeric arguments of a passive op: a fill value that,
    # when not finite, makes the op an origin (NaN) or a benign one (±inf).
    fills: tuple[str, ...] = ()
    # Returns a view of an input: its origin is found through ``_base``, not carried.
    view: bool = False
    # Picks elements by an index tensor (``gather``), or reduces a row to its max (``amax``): a mask's infinity it
    # takes (a masked position picked, a fully masked row's max) is noted as picked (origins.Picked).
    picks: bool = False
    # Lifts a tensor Python made from a literal (``x[3, 2] = float("nan")``, ``torch.tensor(nan)``): the number the
    # code wrote; the tracer keeps a non-finite one for the batch it is written into (:func:`literal_numbers`).
    literal: bool = False


@functools.cache
def plan_of(func: torch._ops.OpOverload) -> Plan:
    """The :class:`Plan` of an op overload (cached: the tracer asks for it at every op)."""
    schema = func._schema
    packet = func.overloadpacket.__name__
    names = tuple(argument.name for argument in schema.arguments)
    writes = frozenset(
        argument.name for argument in schema.arguments
        if argument.alias_info is not None and argument.alias_info.is_write
    )
    outs = frozenset(argument.name for argument in schema.arguments if argument.is_out)
    overwrites = packet in _OVERWRITES
    reads = frozenset(names) - outs - (writes if overwrites else frozenset())
    # With out=, even a passive op may cast its result to a narrower dtype.
    passive = not outs and (packet in _PASSIVE or f"{packet}.{func._overloadname}" in _PASSIVE)
    return Plan(
        names=names,
        passive=passive,
        conversion=_CONVERSIONS.get(packet),
        overwrites=overwrites,
        writes=writes,
        reads=reads,
        numbers=frozenset(
            argument.name for argument in schema.arguments
            if any(word in str(argument.type) for word in ("number", "float", "Tensor"))
        ),
        per_index=packet.startswith(("_foreach_", "_fused_")),
        view=not writes and any(
            ret.alias_info is not None and not ret.alias_info.is_write for ret in schema.returns
        ),
        fills=tuple(
            argument.name for argument in schema.arguments
            if passive and any(word in str(argument.type) for word in ("number", "float", "Scalar"))
            and "Tensor" not in str(argument.type)
        ),
        picks=packet in _PICKS or (packet in _MAXES and func._overloadname in ("default", "dim")),
        literal=packet in _LITERALS,
    )


def arguments(
    plan: Plan, args: Sequence[Any], kwargs: dict[str, Any]
) -> Iterator[tuple[str, Any]]:
    """``(schema name, value)`` of an op's positional and keyword arguments."""
    yield from zip(plan.names, args)
    yield from kwargs.items()


def tensors(
    plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], names: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` of the tensors in the arguments called ``names`` (lists flattened)."""
    for name, value in arguments(plan, args, kwargs):
        if name in names:
            for label, tensor, _position in _flatten_at(name, value):
                yield label, tensor


def op_inputs(
    plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], index: int | None
) -> Iterator[tuple[str, Any]]:
    """``(label, value)`` of the tensors and numeric scalars an op reads.

    For a foreach op only element ``index`` of each list argument is an input
    of output ``index``.
    """
    for name, value in arguments(plan, args, kwargs):
        if name not in plan.reads:
            continue
        if isinstance(value, (list, tuple)):
            pairs = list(enumerate(value))
            if index is not None and len(value) > index:
                pairs = [(index, value[index])]
            for position, item in pairs:
                if isinstance(item, torch.Tensor) or (name in plan.numbers and is_number(item)):
                    yield f"{name}[{position}]", item
        elif isinstance(value, torch.Tensor) or (name in plan.numbers and is_number(value)):
            yield name, value


def flatten(label: str, value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` of a tensor or of the tensors in a list, labelled ``label[i]``."""
    for flat_label, tensor, _position in _flatten_at(label, value):
        yield flat_label, tensor


def _flatten_at(label: str, value: Any) -> Iterator[tuple[str, torch.Tensor, int | None]]:
    """As :func:`flatten`, with each tensor's position in its list (None for a tensor that is no element)."""
    if isinstance(value, torch.Tensor):
        yield label, value, None
    elif isinstance(value, (list, tuple)):
        single = label == "output" and len(value) == 1
        for position, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                yield (label, item, None) if single else (f"{label}[{position}]", item, position)


def list_positions(plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> dict[str, int]:
    """Each output label's position in its list (``"tensors[2]"`` -> 2), as the op tracer labels outputs:
    the returned tensors, else those written in place. A label that names no list element is absent."""
    found = list(_flatten_at("output", out))
    if not found:
        names = plan.writes
        found = [flat for name, value in arguments(plan, args, kwargs) if name in names
                 for flat in _flatten_at(name, value)]
    return {label: position for label, _tensor, position in found if position is not None}


def narrows(plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> bool:
    """Whether a copy can overflow: a source range wider than the target's."""
    source = dict(arguments(plan, args, kwargs)).get(plan.conversion or "")
    target = out if isinstance(out, torch.Tensor) else None
    if not isinstance(source, torch.Tensor) or target is None or not target.is_floating_point():
        return False
    return _range(source.dtype) > torch.finfo(target.dtype).max


@functools.cache
def _range(dtype: torch.dtype) -> float:
    """The largest magnitude a dtype holds."""
    if dtype == torch.bool:
        return 1.0
    if dtype.is_complex:
        dtype = dtype.to_real()
    if dtype.is_floating_point:
        return float(torch.finfo(dtype).max)
    return float(torch.iinfo(dtype).max)


def is_number(value: Any) -> bool:
    """A Python number that may be an op's numeric argument (not a bool flag)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def odd_scalar(plan: Plan, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a passive op was given a non-finite fill value (``masked_fill(mask, nan)``)."""
    return any(
        name in plan.fills and isinstance(value, float) and not math.isfinite(value)
        for name, value in arguments(plan, args, kwargs)
    )


def literal_numbers(plan: Plan, args: Sequence[Any]) -> list[tuple[str, float]]:
    """``[("value", number)]`` where ``plan``'s op lifts a Python number made a 0-dim tensor that is not finite:
    ``x[3, 2] = nan`` runs ``lift_fresh`` on the NaN, then copies it in; ``torch.tensor(nan)`` too. Empty for any other
    op, a finite number, or a literal of rows (``torch.tensor([[1.0, nan]])`` is data, as a loaded batch is), so the op
    stays passive; read only for the lift ops, which a loop or forward runs once per literal."""
    value = args[0] if plan.literal and args else None
    if (not isinstance(value, torch.Tensor) or value.dim() != 0 or not value.is_floating_point()
            or value.is_complex()):
        return []
    number = float(value.item())
    return [] if math.isfinite(number) else [("value", number)]


def run_op(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)``, as a dispatch mode must call it, wrapped numbers included.

    A tensor made from a Python number (``x * 0.5`` saves ``0.5`` as a 0-dim
    float64 "wrapped number", which autograd nodes hand back as
    ``_saved_other``) reaches a Python dispatch mode as the number itself.
    Where another tensor argument is present torch takes the number back, but
    an op on the wrapped number alone (``.detach()``, ``aminmax``) then fails
    with "Expected a value of type 'Tensor' ... found type 'float'" (torch
    2.x). Such an op runs again with the number as the 0-dim tensor it was.
    Only the failure path pays for the check.
    """
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:
        __tracebackhide__ = True  # (IPython and pytest show the user's frames of their error, not ours)
        return run_rewrapped(func, args, kwargs, error)


def run_rewrapped(func: Any, args: Sequence[Any], kwargs: dict[str, Any], error: RuntimeError) -> Any:
    """After ``func(*args, **kwargs)`` raised ``error``: the op again with its wrapped numbers as tensors (run_op
    says why); where it has none, ``error`` itself, raised again as is: the user's own error (a shape mismatch)
    shows as unwatched, not run twice and chained to a second copy of itself."""
    __tracebackhide__ = True
    rewrapped = _rewrapped(func, args, kwargs)
    if rewrapped is None:
        raise error
    return func(*rewrapped[0], **rewrapped[1])


#: The dtype torch gives a tensor wrapped around a Python number.
_WRAPPED_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _rewrapped(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]] | None:
    """The arguments with each Python number in a ``Tensor`` slot made a tensor again; None if there is none."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    slots = {argument.name for argument in schema.arguments if str(argument.type) in ("Tensor", "Optional[Tensor]")}
    found = False

    def wrap(name: str, value: Any) -> Any:
        nonlocal found
        if name in slots and type(value) in _WRAPPED_DTYPES:
            found = True
            return torch.tensor(value, dtype=_WRAPPED_DTYPES[type(value)])
        return value

    new_args = [wrap(name, value) for name, value in zip((a.name for a in schema.arguments), args)]
    new_args += list(args[len(new_args):])
    new_kwargs = {name: wrap(name, value) for name, value in kwargs.items()}
    return (new_args, new_kwargs) if found else None


class _FirstArgument(TorchDispatchMode):
    """Takes the first argument of the op it sees, and runs nothing."""

    seen: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen = args[0] if args else None


def is_wrapped_number(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a Python number torch wrapped for an op (``loss * math.inf`` saves ``inf`` as a 0-dim
    float64 ``_saved_other``): no data the loop read, but a number its code passed. torch has no Python test for
    it; a dispatch mode is handed such a tensor as the number itself (see :func:`run_op`). At an event only."""
    if tensor.dim() != 0 or tensor.device.type != "cpu" or tensor.dtype not in _WRAPPED_DTYPES.values():
        return False
    probe = _FirstArgument()
    with probe:
        torch.ops.aten.alias.default(tensor)
    return not isinstance(probe.seen, torch.Tensor)


def op_name(func: torch._ops.OpOverload) -> str:
    """The overload's name as a finding shows it, e.g. ``"aten.div.Tensor"``."""
    return f"{func.namespace}.{func.overloadpacket.__name__}.{func._overloadname}"

