"""The records of one step's calls: a module call, each of its tensors' probe, a pass-through's alias.

Hooks append these and do nothing else on the fast path: one ``aminmax`` per
floating output, a few Python objects, no host synchronisation when deferred.
Tensors are held by weak reference only, so nothing is kept alive beyond what
the user's program (and autograd) keeps; a report built while a tensor is
still alive gets its full statistics, otherwise the probe's. The step's log
of them, and the identity map that finds a tensor's consumer: calls.py.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from nan_magic.hot.object_reads import key_text
from nan_magic.hot.reads import (
    WIDE_FLOATS,
    is_checkable,
    iter_tensors,
    probe,
    probe_kinds,
    readable,
    version_of,
)
from nan_magic.hot.stats import (
    finite_stats,
    probe_stats,
    tensor_stats,
)
from nan_magic.hot.watched.targets import ModuleInfo
from nan_magic.records import LayerStatus, Phase, TensorRef, TensorRole, TensorStats

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from nan_magic.hot.kept.held import HeldArguments
    from nan_magic.hot.kept.rng import AutocastState, RngState

__all__ = [
    "FIRST_ARGUMENT", "Alias", "Call", "Frame", "KnownFinite", "TensorRecord", "argument_path", "argument_tensors",
    "array_values", "calling_model", "consumer_of", "gradient_label", "nested_values",
]

_NONE: frozenset[str] = frozenset()


#: The path of the batch: the first positional argument of a model call, ``module(x)``.
FIRST_ARGUMENT = "input[0]"


def argument_path(prefix: str, argument: int | str) -> str:
    """The path of a whole argument: ``input[0]``, ``kwargs['mask']`` (``prefix``: ``"input"`` or ``"kwargs"``).
    (Written inline as this f-string where every call's arguments are read: a Python call each.)"""
    return f"{prefix}[{argument!r}]"


def argument_tensors(
    values: tuple[Any, ...] | Mapping[str, Any], prefix: str, skipped: Counter[str] | None = None, *,
    attributes: bool = False,
) -> list[tuple[str, int | str, torch.Tensor]]:
    """``(path, argument, tensor)`` for every checkable tensor in a call's arguments.

    ``values`` are the positional arguments (``prefix`` ``"input"``) or the
    keyword arguments (``"kwargs"``); ``argument`` is the position or keyword
    of the argument that holds the tensor, a field the producer rule reads
    the forward parameter's name by (localize/ops/masks.py), never parsed from the path.
    ``attributes``: a plain object's own tensor attributes too (:func:`iter_tensors`), for the batch entering a
    model, read once per top-level call.
    """
    arguments = values.items() if isinstance(values, Mapping) else enumerate(values)
    return [
        (path, argument, tensor)
        for argument, value in arguments
        for path, tensor in iter_tensors(value, f"{prefix}[{argument!r}]", skipped, attributes=attributes)
    ]


def nested_values(
    values: tuple[Any, ...] | Mapping[str, Any], prefix: str
) -> list[tuple[str, int | str, torch.Tensor]]:
    """``(path, argument, values)`` for each nested floating tensor among a call's arguments (an argument, or an
    item of a list or tuple argument): its values as one dense tensor (``values()``, a view of its buffer, jagged or
    strided), which the watch reads where the nested tensor itself has no single shape to reduce (hot/reads.py).
    For the batch entering a model: a NaN a jagged batch brings in is data, not the first dense tensor holding it."""
    arguments = values.items() if isinstance(values, Mapping) else enumerate(values)
    found: list[tuple[str, int | str, torch.Tensor]] = []
    for argument, value in arguments:
        path = argument_path(prefix, argument)
        items = (list(enumerate(tuple.__iter__(value) if isinstance(value, tuple) else list.__iter__(value)))
                 if isinstance(value, (list, tuple)) else [(None, value)])  # (as stored: a subclass's __iter__ is code)
        for index, item in items:
            if isinstance(item, torch.Tensor) and item.is_nested and item.is_floating_point():
                # A jagged tensor's own buffer, which lives as long as it does (the deferred check reads it a step
                # later, from the call's kept arguments); ``values()`` makes a new view each time, gone by then.
                buffer = item._values if item.layout is torch.jagged else None
                dense = buffer if type(buffer) is torch.Tensor and not buffer.requires_grad else item.detach().values()
                if is_checkable(dense):
                    found.append((path if index is None else f"{path}[{index}]", argument, dense))
    return found


def array_values(
    values: tuple[Any, ...] | Mapping[str, Any], prefix: str
) -> list[tuple[str, int | str, torch.Tensor]]:
    """``(path, argument, values)`` for each floating numpy array among a call's arguments (an argument, a value of
    a dict argument, an item of a list or tuple argument): a tensor over the array's own memory
    (``torch.from_numpy``, no copy), read as a tensor batch is. And a list or tuple argument of Python numbers, or of
    rows of them, that holds one not finite: as a float64 tensor (:func:`unfinite_numbers`). For the batch entering
    a model that converts it in its own ``forward`` (``torch.as_tensor(x)``, as a scikit-learn-style wrapper or a
    policy given an environment's observation does): a NaN it brings in is data, not the first op of the model's
    code."""
    numpy = sys.modules.get("numpy")  # (never imported here: a program without numpy passes no array)
    arguments = values.items() if isinstance(values, Mapping) else enumerate(values)
    found: list[tuple[str, int | str, torch.Tensor]] = []
    for argument, value in arguments:
        if type(value) is torch.Tensor:  # (the usual argument: no array in it)
            continue
        path = f"{prefix}[{argument!r}]"  # (argument_path, inlined: every top-level call's arguments)
        is_sequence = type(value) is list or type(value) is tuple
        if is_sequence and value and (numbers := unfinite_numbers(value)) is not None:
            found.append((path, argument, numbers))
            continue
        if numpy is None:
            continue
        if is_sequence:
            items = [(f"{path}[{index}]", item) for index, item in enumerate(value) if isinstance(item, numpy.ndarray)]
        elif isinstance(value, dict):  # (dict.items and key_text: a dict subclass's items(), a key's __repr__: code)
            items = [(f"{path}[{key!r}]" if type(key) is str else f"{path}[{key_text(key)}]", item)
                     for key, item in dict.items(value)]
        else:
            items = [(path, value)]
        for item_path, item in items:
            # A read-only array (a memory-mapped file's) would make torch warn: it is left unread.
            if (isinstance(item, numpy.ndarray) and item.dtype.kind == "f" and item.dtype.itemsize in (2, 4, 8)
                    and item.flags.writeable and item.size):
                try:
                    found.append((item_path, argument, torch.from_numpy(item)))
                except (TypeError, ValueError):  # a negative stride (``a[::-1]``), another byte order: left unread
                    continue
    return found


def unfinite_numbers(rows: list[Any] | tuple[Any, ...]) -> torch.Tensor | None:
    """A list (or tuple) of Python numbers, or of rows of them, as a float64 tensor, where one is not finite: the
    rows a CSV reader or an environment gave, which the model makes a tensor of itself (``torch.tensor(rows)``).
    None where every number is finite (the usual batch: their sum is, and no tensor is made), and for any other
    list (of tensors, of strings, ragged rows)."""
    first = rows[0]
    try:
        # (math.fsum: numbers only, in C; +inf and -inf together raise ValueError, not finite either)
        if isinstance(first, (float, int)):
            total = math.fsum(rows)
        elif (type(first) is list or type(first) is tuple) and first and isinstance(first[0], (float, int)):
            total = math.fsum(map(math.fsum, rows))
        else:
            return None
    except ValueError:
        total = math.nan
    except (TypeError, OverflowError, RuntimeError):  # (not numbers; finite numbers past a float's range)
        return None
    if math.isfinite(total):
        return None
    try:
        return torch.tensor(rows, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):  # (ragged rows: no tensor of them)
        return None


class TensorRecord:
    """One probed tensor: where it came from and its ``(min, max)``."""

    # Both __init__ and finite() set every slot: a slot added here goes in both.
    __slots__ = (
        "_probe", "argument", "call", "consumers", "dtype", "high", "inner", "kinds", "low", "outer", "path", "ranged",
        "ref", "shape", "status", "version",
    )

    #: ``path`` is where in the call's output (``"output[1]"``) or arguments (``"input[0]"``) the tensor is;
    #: a tensor that is neither (a gradient, the loss, a value passed to a child) carries its reference.
    def __init__(
        self,
        path: str | TensorRef,
        tensor: torch.Tensor,
        call: Call | None,
        hold: bool,
        same: TensorRecord | None = None,
        ranged: bool = True,
    ) -> None:
        self.path = path
        #: For a tensor entering a model (a data call's record): the position or keyword of its argument.
        self.argument: int | str | None = None
        self.dtype = tensor.dtype
        # The tensor itself is what identity and versions follow; what is probed
        # is its values (reads.values_to_read: a complex tensor's real view, a
        # sparse one's stored values), whose shape the stats describe.
        # (readable() and version_of() inlined: a record is made for each boundary tensor of every step)
        if (type(tensor) is torch.Tensor and tensor.layout is torch.strided and not tensor.dtype.is_complex
                and tensor.itemsize != 1):  # (float8: widened by readable())
            values = tensor
        else:
            values = readable(tensor)
        self.shape = tuple(values.shape)
        self.ref = weakref.ref(tensor)
        try:
            self.version = tensor._version
        except RuntimeError:  # an inference tensor has no version counter (version_of)
            self.version = 0
        self.call = call
        self.status: LayerStatus = "ok"
        self.consumers: list[Call] = []
        # The record of the same tensor returned again by an enclosing call
        # (nn.Sequential returns its last child's output object).
        self.outer: TensorRecord | None = None
        # The record of the same tensor object seen earlier this step (set by StepLog).
        self.inner: TensorRecord | None = None
        self._probe: tuple[torch.Tensor, torch.Tensor] | None = None
        self.low = self.high = math.nan
        #: Non-finite kinds the probe shows; empty until a pending probe is read.
        self.kinds: frozenset[str] = _NONE
        #: Whether ``low`` and ``high`` are known (see ``ranged`` below).
        self.ranged = True
        # Only finiteness asked (a float32 gradient): a sum, a third of the time
        # of aminmax on the CPU, answers it. A non-finite sum (or one that
        # overflowed) gets the exact probe below.
        summed = not ranged and not hold and same is None and values.is_cpu and values.dtype in WIDE_FLOATS
        if summed and math.isfinite(float(values.detach().sum())):
            self.ranged = False
            return
        if same is not None and same._probe is None:
            # The same, unchanged tensor seen again (nn.Sequential returns its
            # last child's output; an add passes one gradient to both inputs):
            # its probe is already known.
            self.ranged = same.ranged
            if same.ranged:
                self.set_probe(same.low, same.high)
            return
        if not hold and not self.shape:
            # A 0-d tensor read at once (the loss, every step): its value is its min and its max, so one host read
            # of it gives what aminmax's two would, and the step runs no reduction and makes no tensor for it.
            # (``.item()``: ``float()`` of a tensor that requires grad warns; a dual loss reads as its primal.)
            self.low = self.high = value = values.item()
            self.kinds = _NONE if -math.inf < value < math.inf else probe_kinds(value, value)
            return
        low, high = same._probe if same is not None and same._probe is not None else probe(values)
        if hold:
            self._probe = (low, high)  # read with the step's others, at its check (StepLog.resolve)
        else:  # (set_probe, inlined: every boundary tensor; float(), not .item(): no Python call)
            self.low, self.high = read_low, read_high = float(low), float(high)
            self.kinds = _NONE if -math.inf < read_low <= read_high < math.inf else probe_kinds(read_low, read_high)

    @classmethod
    def finite(cls, path: str | TensorRef, dtype: torch.dtype, shape: tuple[int, ...], call: Call) -> TensorRecord:
        """The record of a tensor found finite earlier by its sum, no longer referred to."""
        record = cls.__new__(cls)
        record.path, record.dtype, record.shape, record.call, record.argument = path, dtype, shape, call, None
        record.ref, record.version = _gone, 0  # type: ignore[assignment]  # called like a dead weakref
        record.status, record.consumers, record.outer, record.inner = "ok", [], None, None
        record._probe, record.low, record.high, record.kinds, record.ranged = None, math.nan, math.nan, _NONE, False
        return record

    def set_probe(self, low: float, high: float) -> None:
        self.low, self.high = low, high
        # Finite is the common case: skip the classification then.
        self.kinds = _NONE if -math.inf < low <= high < math.inf else probe_kinds(low, high)

    def outward(self) -> Iterator[TensorRecord]:
        """This record, then those of the enclosing calls that returned the same tensor again."""
        record: TensorRecord | None = self
        while record is not None:
            yield record
            record = record.outer

    @property
    def pending(self) -> bool:
        return self._probe is not None

    def live(self) -> torch.Tensor | None:
        """The tensor itself if it is still alive and unchanged since probed."""
        tensor = self.ref()
        if tensor is None or version_of(tensor) != self.version:
            return None
        return tensor

    def stats(self) -> TensorStats:
        """Exact stats when the tensor is alive, else what the probe knows."""
        tensor = self.live()
        if tensor is not None:
            return tensor_stats(tensor)
        if not self.ranged:
            return finite_stats(self.dtype, self.shape)
        return probe_stats(self.dtype, self.shape, self.low, self.high)


def _gone() -> None:
    """A dead reference: what :meth:`TensorRecord.finite` records point to."""
    return None


def calling_model(call: Call) -> str | None:
    """The label of the model whose call ran ``call``: its module's own, except for a module two models share (one
    encoder in an encoder and a decoder model, named once, under the first), run by the other one, the nearest
    enclosing model call that holds it (a model called inside another's forward is its own). At an event only."""
    info = call.info
    if info is None or info.is_root:
        return None if info is None else info.model
    parent = call.parent
    while parent is not None and (parent.info is None or not parent.info.is_root):
        parent = parent.parent
    if parent is None or parent.info is None or parent.info.model == info.model:
        return info.model
    outer, module = parent.module, call.module
    if isinstance(outer, torch.nn.Module) and any(held is module for held in outer.modules()):
        return parent.info.model
    return info.model


class Call:
    """One call of a watched module (or the data entering a root, or the loss)."""

    __slots__ = (
        "autocast", "consumer", "deliberate_kinds", "finished", "held", "index", "info", "inner_kinds", "inputs",
        "loss_of", "model_call", "module", "outputs", "parent", "phase", "plain", "rng_state", "target", "unread",
    )
    #: A backward check's call, set by its gradient hook only (unset elsewhere: read with getattr): the backward
    #: pass it came from, as its loss's record, the loss's id and the line that called backward
    #: (gradient_checks.py), so the first of two backward passes before a step is judged from its own loss code.
    loss_of: tuple[TensorRecord | None, int | None, tuple[Any, int, int] | None]
    #: A backward check's call, set by its gradient hook only (read with getattr): the record of the forward tensor
    #: whose gradient it holds, for the deferred check, which judges it after the hook returned (gradient_checks.py).
    target: TensorRecord

    def __init__(self, index: int, phase: Phase, info: ModuleInfo | None, module: Any, parent: Call | None) -> None:
        self.index = index
        self.phase = phase
        # The step's how-manieth top-level model call was running (or had last run) when this call was made, from 1
        # (StepLog.model_calls): which micro-batch of gradient accumulation it belongs to. 0: not counted (a replay's).
        self.model_call = 0
        self.info = info
        self.module = module
        self.parent = parent
        # ``(path, argument, record, weak tensor, its version)`` of each tensor argument; ``argument`` is the
        # position or keyword of the argument that holds it (argument_tensors).
        self.inputs: list[tuple[str, int | str, TensorRecord | None, weakref.ref[torch.Tensor], int]] = []
        self.outputs: list[TensorRecord] = []
        self.finished = -1
        # Kinds that the outputs of calls made inside this one produced: a
        # parent passing on what its child produced is a propagator.
        self.inner_kinds: frozenset[str] = _NONE
        # Deliberate infinities (masks) that calls made inside this one produced.
        self.deliberate_kinds: frozenset[str] = _NONE
        # For a replay of a forward call after it returned (localize/replay/module_run.py: its
        # backward, or the call at the deferred check): its arguments held
        # weakly, the RNG state before it and the autocast regions it ran in.
        self.held: HeldArguments | None = None
        # Where no call holds its arguments (ops=True judged at the step's end): its arguments with each value that
        # is not a plain Python one (a tensor, an object) left as NOT_PLAIN, for the scene (plain_arguments).
        self.plain: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.rng_state: RngState | None = None
        self.autocast: AutocastState | None = None
        # For a backward check: the forward call whose backward computed the gradient.
        self.consumer: Call | None = None
        # Why a forward call's output gave no tensor to read (reads.unread_parts): a report must not say every
        # module output was finite where this one was never read.
        self.unread: tuple[str, ...] = ()

    @property
    def name(self) -> str | None:
        return self.info.name if self.info is not None else None

    @property
    def module_type(self) -> str | None:
        return self.info.module_type if self.info is not None else None


class Alias:
    """The output of a passed-through call (transparent.py), standing for its input's record.

    ``record`` is the record the call's input goes back to (through chains
    of pass-throughs), used to find consumers; ``origin`` is what the input
    itself can be recomputed from (its record, or the alias of the
    pass-through before), so a replay can recompute the output too.
    """

    __slots__ = ("bound", "input", "module", "origin", "record", "ref", "rng_state", "version")

    #: ``path`` is where in the call's output (``"output[1]"``) or arguments (``"input[0]"``) the tensor is;
    #: a tensor that is neither (a gradient, the loss, a value passed to a child) carries its reference.
    def __init__(
        self,
        tensor: torch.Tensor,
        record: TensorRecord,
        module: Any,
        source: torch.Tensor,
        origin: TensorRecord | Alias,
        rng_state: RngState | None,
        bound: float,
    ) -> None:
        self.ref = weakref.ref(tensor)
        try:  # (version_of, inlined: every pass-through of a per-module step)
            self.version = tensor._version
        except RuntimeError:  # an inference tensor has none
            self.version = 0
        self.record = record
        self.module = module
        self.input = weakref.ref(source)
        self.origin = origin
        self.rng_state = rng_state
        #: A bound on the output's magnitude (transparent.output_bound).
        self.bound = bound


#: ``(record, low, high, origin)``: see :meth:`StepLog.known_finite`.
KnownFinite = tuple[TensorRecord, float, float, "TensorRecord | Alias"]


def consumer_of(record: TensorRecord) -> Call | None:
    """The call whose backward computes the gradient of ``record``'s tensor.

    The innermost watched module that took the tensor as input; with none,
    the functional code of the producing call's parent (None at top
    level: the loss). A tensor that enclosing calls returned as their own
    output is consumed where the outermost of them handed it on.
    """
    while record.outer is not None:
        record = record.outer
    if record.consumers:
        return record.consumers[-1]
    return record.call.parent if record.call is not None else None


def gradient_label(record: TensorRecord, consumer: Call | None) -> TensorRef:
    """The gradient of ``input[0]`` as the consumer saw it, else of the output of the outermost call returning it.

    The outermost (the model, named ``""``), as :func:`consumer_of` walks: the per-module watch records the
    innermost producer too, the tiered one only the model, and both must name the model's output alike.
    """
    if consumer is not None:
        for path, _argument, input_record, _ref, _version in consumer.inputs:
            if input_record is record:
                return TensorRef(TensorRole.OUTPUT_GRADIENT, None, path)
    while record.outer is not None:
        record = record.outer
    owner = record.call.name if record.call is not None else None
    return TensorRef(TensorRole.OUTPUT_GRADIENT, owner or "", str(record.path))


class Frame:
    """A watched module call in progress (the module stack).

    A passed-through call (transparent.py) has no ``call``; ``through`` is
    the input it received. The forward hooks push it; a replay starts from
    one (localize/replay/producer_call.py).
    """

    __slots__ = ("args", "call", "info", "known", "module", "rng_state", "task", "through")

    def __init__(
        self,
        module: nn.Module,
        info: ModuleInfo,
        call: Call | None,
        rng_state: RngState | None,
        through: torch.Tensor | None = None,
        known: KnownFinite | None = None,
        task: int = -1,
        args: tuple[Any, ...] | None = None,
    ) -> None:
        self.module = module
        self.info = info
        self.call = call
        self.rng_state = rng_state
        self.through = through
        #: What was known of ``through`` when the call began.
        self.known = known
        #: The autograd graph task the call began in (-1 outside backward): its post-hook's too, not asked again.
        self.task = task
        #: The positional arguments ``module.__call__`` received, before the module's own forward pre-hooks: a
        #: replay calls the module again, so its pre-hooks run again on them (None where no replay starts here).
        self.args = args


#: What :func:`plain_arguments` leaves where an argument is not a plain Python value.
NOT_PLAIN = object()
_PLAIN = (type(None), bool, int, float, str)


def plain_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's arguments with only its plain Python values (None, bool, int, float, str) kept: ``model(xs, step)``'s
    step, which a scene saves beside the tensors; the rest left as :data:`NOT_PLAIN` (no tensor held)."""
    return (tuple(arg if type(arg) in _PLAIN else NOT_PLAIN for arg in args),
            {key: value if type(value) in _PLAIN else NOT_PLAIN for key, value in kwargs.items()})
