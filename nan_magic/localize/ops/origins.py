"""The producer op's record, and the origin the op tracer notes for each non-finite tensor.

An :class:`OpFinding` is what the tracer (:mod:`nan_magic.localize.ops.tracer`) reports: the op that first made a
non-finite value from finite or benign inputs, with its line, its inputs' statistics and its scalar arguments. Every
non-finite tensor the tracer sees is noted in an :class:`Origins` table with where its values began: an op
(:class:`Origin`, holding that op's finding), a deliberate infinity (:data:`BENIGN`: a mask, an infinite fill, or what
carries one on), or nothing (it came from outside the trace). A tensor is known by its identity and version counter, and
a forward value that autograd saved for backward, which then reaches a backward op as a new Python object on the same
memory, is known by that memory while its storage lives. An inference tensor (made under ``torch.inference_mode()``) has
no version counter: it is known by its identity alone, and an op that writes it in place notes it again.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.reads import is_checkable_op_value
from nan_magic.hot.stats import PendingCounts, sample_values, tensor_stats
from nan_magic.localize.ops.log_edge import LOG_EDGES
from nan_magic.plain import to_pairs
from nan_magic.records import AbsorbedOp, Note, Phase, Sample, SourcePointer, TensorRef, TensorRole, TensorStats
from nan_magic.tensor_refs import op_function

__all__ = ["BENIGN", "Benign", "OpFinding", "Origin", "Origins", "Picked", "apply_op_finding", "attach_origin", "dense"]


@dataclass(frozen=True)
class OpFinding:
    """The producer op: the first op whose output held a new non-finite kind."""

    #: The aten overload, e.g. ``"aten.div.Tensor"``.
    op: str
    #: ``forward``, ``backward`` (run inside the autograd engine), or the tracer's ``phase_hint`` (``optimizer``).
    phase: Phase
    #: The tracer's ``module_name()`` at the op; for a backward op, when its node's forward op ran.
    module: str | None
    #: The innermost frame of the user's code (outside torch and nan_magic) that ran the op, ``loss.backward()`` or
    #: ``opt.step()``; None where none is on the stack (a backward op on an autograd worker thread).
    source: SourcePointer | None
    #: The innermost Python frame below ``source`` that ran the op (``torch/nn/functional.py``), None if ``source``.
    inner_source: SourcePointer | None
    #: For a backward op, the user's forward line that created its autograd node (:class:`OpTracer`).
    forward_source: SourcePointer | None
    #: For a backward op, its node's name, e.g. ``"SqrtBackward0"``.
    autograd_node: str | None
    #: The output that went bad: ``"output"``, ``"output[1]"``, or an in-place op's mutated argument (``"self[3]"``).
    tensor: str
    #: The watched kinds the output held and no input held, in :data:`nan_magic.records.KINDS` order.
    new_kinds: tuple[str, ...]
    nan: int
    posinf: int
    neginf: int
    numel: int
    output_stats: TensorStats
    #: Every tensor input by schema argument (``"self"``, ``"tensors[2]"``); an in-place op's mutated tensor before
    #: the op is marked ``before`` and known only through its probe (counts of a present kind are None).
    input_stats: tuple[tuple[TensorRef, TensorStats], ...]
    #: ``(name, value)`` of the numeric scalar arguments (``eps``, ``alpha``).
    scalars: tuple[tuple[str, float], ...]
    #: For a backward op: the forward op whose non-finite output it read though no boundary saw that value
    #: (absorbed by ``torch.where`` or ``tanh``), e.g. ``exp`` for ``0 * inf`` in ``ExpBackward0``.
    absorbed: OpFinding | None = None
    #: For a backward op: it ran in Python code the autograd engine called (a custom ``autograd.Function``'s
    #: ``backward``, a gradient hook), and ``source`` is that code's line.
    backward_code: bool = False
    #: Small samples of the op's output and operands, drawn when it ran: for the histograms of a
    #: report whose op output is freed before the boundary that claims it (most intermediates).
    samples: tuple[Sample, ...] = ()
    #: For a backward op: its node's ``_sequence_nr()``, which names the forward op's line
    #: (:class:`~nan_magic.localize.ops.sources.NodeSources`) and, counted from a replayed call's
    #: start, where a replay of that call makes the node again (replay/line_replay.py).
    node_number: int | None = None
    #: The torch function the line called whose own number the op read (``logdet``: called.py), else None.
    own_number: str | None = None
    #: An ``x * log(y)`` op's infinities where y was at its log's edge (xlogy's 0, xlog1py's -1), counted when it
    #: ran (log_edge.py); None for another op.
    log_edge: int | None = None
    #: A forward division's divisor made by a std, a variance or a norm (divisor.py): that spread, else None.
    spread: str | None = None
    #: Ops mode: the loop ran the op in its data region (before the step's first model call, outside every watched
    #: module) on tensors no parameter nor model output went into (derived.ModelDerived): phase data (PRODUCT.md).
    from_data: bool = False

    @property
    def dtype(self) -> str:
        """The bad output's dtype name, e.g. ``"float16"``."""
        return self.output_stats.dtype


@dataclass(frozen=True)
class Origin:
    """A non-finite value started by an op (its finding)."""

    finding: OpFinding


class Benign:
    """A non-finite value that is a deliberate infinity (a mask, an infinite fill), or carries one."""


BENIGN = Benign()


class Picked(Benign):
    """Deliberate infinities an index op picked out of a tensor that carries a mask (``log_probs.gather(1, a)``), or
    a max reduced of it (``amax`` over a fully masked row: -inf).

    Benign while they go on as a mask does (a beam search gathers the -inf scores of finished beams on purpose; a
    pooling that cleans its empty rows). A sum or mean that then adds them up (origin_rules.py: ``reduces_a_mask``),
    or a consumer that makes a new kind of them (a head's matmul, a square), names the pick, not itself: an index
    chose a masked position (an action the policy masked), a max reduced nothing. Held until the step ends (the
    tracer's reset): the pick's output, weak references to its inputs, and its line and module, taken as it ran.
    """

    def __init__(self, op: str, output: torch.Tensor, inputs: list[tuple[str, Any]], source: SourcePointer | None,
                 inner_source: SourcePointer | None, module: str | None, phase: Phase,
                 frame: tuple[int, Any, int, int] | None, whole_rows: bool = False) -> None:
        self.op, self.output, self.source, self.inner_source, self.module, self.phase = (
            op, output, source, inner_source, module, phase)
        #: Whether the pick selected whole rows of the mask (``logits[live]``: masks.selects_whole_rows): a softmax
        #: or logsumexp over such a row is judged as on the mask itself (the consumer is named), any other consumer
        #: that makes a new kind names the pick (a padded time step selected whole, then a head's matmul).
        self.whole_rows = whole_rows
        #: ``(id, code, f_lasti, f_lineno)`` of the user's frame that ran the pick (no reference: %debug opens there
        #: where the op that names it runs in that frame still).
        self.frame = frame
        self.inputs = [(name, weakref.ref(value) if isinstance(value, torch.Tensor) else value)
                       for name, value in inputs]

    def alive_inputs(self) -> list[tuple[str, Any]]:
        """The pick's inputs that still live (a temporary index is gone by the sum), and its scalars."""
        return [(name, value() if isinstance(value, weakref.ref) else value) for name, value in self.inputs
                if not isinstance(value, weakref.ref) or value() is not None]


def dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is strided: it has one storage (a sparse one's values are its own)."""
    return tensor.layout is torch.strided


# The version an inference tensor's origin is noted at: it has no version counter.
_NO_VERSION = -1

#: Tensor types whose memory can stand for a tensor whose Python object is gone (origins by memory).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _memory_key(storage: torch.UntypedStorage, tensor: torch.Tensor) -> tuple[Any, ...]:
    return storage.data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device


#: What ``_by_memory`` holds of a noted tensor: its version, whether an op wrote it in place, its origin, a weak
#: reference to its storage (the address alone outlives it: see :meth:`Origins.memory_entry`), and whether it was a
#: Parameter (not an alias of one, whose version counter is its own).
_MemoryEntry = tuple[int, bool, Origin | Benign, StorageWeakRef, bool]


def _memory_entry(tensor: torch.Tensor, written: bool, origin: Origin | Benign) -> tuple[tuple[Any, ...], _MemoryEntry]:
    storage = tensor.untyped_storage()
    return _memory_key(storage, tensor), (tensor._version, written, origin, StorageWeakRef(storage),
                                          type(tensor) is torch.nn.Parameter)


def _gapless(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` covers its memory with no gap and no overlap: a contiguous
    layout, or a permutation of one (a transpose's)."""
    step = 1
    for size_stride, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if size_stride != step:
            return False
        step *= size
    return True


class Origins:
    """The origin of each non-finite tensor seen in a step, by identity and by memory (not a view: its base's)."""

    def __init__(self) -> None:
        # id(tensor) -> (weak reference, version, written in place, origin) of the non-finite tensors seen.
        self._by_id: dict[int, tuple[weakref.ref[torch.Tensor], int, bool, Origin | Benign]] = {}
        # Forward origins by where their values live: autograd saves an op's output for its backward as another
        # tensor object on the same memory (``exp`` saves its result), which a backward op then reads.
        self._by_memory: dict[tuple[Any, ...], _MemoryEntry] = {}
        # By the weak reference noted (held, so its id stays unique): a tensor freed since, whose id another tensor
        # may have taken in ``_by_id``, is still found by the reference its boundary record holds. With ``counting``
        # (the deferred check's live tracer): its counts, for a boundary the check finds freed (_counted).
        self._by_ref: dict[int, tuple[weakref.ref[torch.Tensor], Origin | Benign, PendingCounts | None]] = {}
        self.counting = False  # (with it: the kinds the tracer read of a tensor, whether a watched module runs)
        self.known: Callable[[torch.Tensor], frozenset[str] | None] = lambda _tensor: None
        self.in_module: Callable[[], bool] = lambda: False

    def __bool__(self) -> bool:
        """Whether any tensor is noted (until then the tracer has nothing to look up or carry on)."""
        return bool(self._by_id)

    def entry_by_ref(self, ref: weakref.ref[torch.Tensor]) -> Origin | Benign | None:
        """The origin noted for the tensor ``ref`` refers to, alive or freed since: a boundary's record holds the
        same weak reference (``weakref.ref`` hands out one per tensor), which the deferred check has where the
        tensor is gone (a loss temporary, an output the next op consumed)."""
        entry = self._by_ref.get(id(ref))
        return entry[1] if entry is not None and entry[0] is ref else None

    def stats_by_ref(self, ref: weakref.ref[torch.Tensor]) -> TensorStats | None:
        """The counts of the freed tensor ``ref`` refers to, where ``counting`` kept them (a gradient into a module's
        output, freed by the deferred check): read now, the other numbers unknown."""
        entry = self._by_ref.get(id(ref))
        counts = entry[2] if entry is not None and entry[0] is ref else None
        return counts.stats() if counts is not None else None

    def stepped(self) -> list[torch.Tensor]:
        """The live tensors whose origin outlasts the start of a step: those an optimizer's step made non-finite
        (the deferred check judges them once the next began), and those the loop's code made outside every module
        (a batch passed by keyword, ``model(pixel_values=x)``, which the call's pre-hook does not see to keep)."""
        return [tensor for ref, _version, _written, origin in self._by_id.values()
                if isinstance(origin, Origin) and (origin.finding.phase == Phase.OPTIMIZER or (
                    origin.finding.phase == Phase.FORWARD and origin.finding.module is None))
                and (tensor := ref()) is not None]

    def clear(self) -> None:
        """Forget every origin (a new step)."""
        self._by_id.clear()
        self._by_ref.clear()
        self._by_memory.clear()

    def entry(self, tensor: torch.Tensor) -> Origin | Benign | None:
        """The origin noted for ``tensor``, or for the tensor it is a view of (views are not carried)."""
        entry = self._by_id.get(id(tensor))
        if entry is not None and entry[0]() is not tensor:
            entry = None  # a dead tensor's entry under a reused id: it must not hide the base's
        if entry is None and tensor._base is not None:
            entry = self._by_id.get(id(tensor._base))
            tensor = tensor._base
        if entry is None or entry[0]() is not tensor:
            # An op's output that only C++ held (inside matmul) lost its Python
            # object, and the view of it is seen through a new one: by memory.
            return self.memory_entry(tensor)
        if entry[1] == _NO_VERSION:
            return entry[3]
        # Autograd bumps the version of a tensor written in place after the
        # op returns here: such an entry holds for the version before or after.
        if tensor._version - entry[1] not in ((0, 1) if entry[2] else (0,)):
            return None
        return entry[3]

    def memory_entry(self, tensor: torch.Tensor) -> Origin | Benign | None:
        """The origin noted for a forward value on ``tensor``'s memory, at its version."""
        if not self._by_memory or tensor.is_inference() or type(tensor) not in _PLAIN or not dense(tensor):
            return None
        try:  # (a value torch.func made, a hessian under vmap read by the loss, has no storage to read)
            entry = self._by_memory.get(_memory_key(tensor.untyped_storage(), tensor))
        except RuntimeError:
            return None
        if entry is None or entry[3].expired():
            # A storage freed since: the allocator hands its address to the next tensor of that size, at version 0
            # as the noted one was (a backward's bool mask, then the next one: a NaN's origin taken for benign).
            return None
        # (a write's entry holds for the version after it too: autograd bumps it after the op returns)
        if tensor._version - entry[0] in ((0, 1) if entry[1] else (0,)):
            return entry[2]
        # A write through ``p.data`` (a max-norm renorm ``w.data.mul_(scale)``, an ActNorm's init) wrote the Parameter
        # through an alias whose version counter is its own: the Parameter's says nothing of that write. (A write
        # after it is traced too: a non-finite one notes its own origin here, a finite one leaves no NaN to look up.)
        return entry[2] if entry[1] and not entry[4] and type(tensor) is torch.nn.Parameter else None

    def reshaped_entry(self, tensor: torch.Tensor) -> Origin | Benign | None:
        """The origin noted for a contiguous value on ``tensor``'s memory in another shape, at its version.

        A parameter's gradient that a broadcast's backward summed (``(grad * x).sum(0, keepdim=True)``, shape
        ``(1, 4)``) is reshaped to the parameter's ``(4,)`` on its way into ``.grad``, by an alias that is no view:
        the same memory, the same values in the same order. Or in another order: the gradient of a transposed
        parameter (``qr(self.linear.weight.T)``) is the permuted alias of the column-major output of the formula that
        made it, the same elements. Cold: a boundary's claim that found nothing else.
        """
        if not self._by_memory or tensor.is_inference() or type(tensor) not in _PLAIN or not (
                dense(tensor) and tensor.is_contiguous()):
            return None
        address, offset = tensor.untyped_storage().data_ptr(), tensor.storage_offset()
        for (ptr, start, shape, stride, dtype, device), entry in self._by_memory.items():
            if (ptr, start, dtype, device) != (address, offset, tensor.dtype, tensor.device) or entry[3].expired():
                continue
            if shape.numel() == tensor.numel() and _gapless(shape, stride) and (
                    tensor._version - entry[0] in ((0, 1) if entry[1] else (0,))):
                return entry[2]
        return None

    def holding_entry(self, tensor: torch.Tensor) -> Origin | Benign | None:
        """The origin noted for a value whose memory holds ``tensor``'s: a parameter rebound to a slice of a vector
        an op made (``vector_to_parameters``, which runs no op of its own). Cold: a boundary's claim that found
        nothing else."""
        if not self._by_memory or tensor.is_inference() or not (dense(tensor) and tensor.is_contiguous()):
            return None
        address, first = tensor.untyped_storage().data_ptr(), tensor.storage_offset()
        for (ptr, start, shape, stride, dtype, device), entry in self._by_memory.items():
            if ((ptr, dtype, device) == (address, tensor.dtype, tensor.device) and not entry[3].expired()
                    and _gapless(shape, stride) and start <= first and first + tensor.numel() <= start + shape.numel()):
                return entry[2]
        return None

    def note(self, tensor: torch.Tensor, origin: Origin | Benign, written: bool = False) -> None:
        """Note ``tensor``'s origin; ``written``: the op wrote it in place (its version moves after)."""
        origins = self._by_id
        ref = weakref.ref(tensor)
        self._by_ref[id(ref)] = (ref, origin, self._counted(tensor, origin))
        if tensor.is_inference():  # no version counter, nor memory that another tensor object could stand for
            origins[id(tensor)] = (ref, _NO_VERSION, written, origin)
            return
        origins[id(tensor)] = (ref, tensor._version, written, origin)
        if type(tensor) in _PLAIN and dense(tensor):  # a sparse tensor has no one storage
            # A write is found by memory too: ``p.detach().copy_(...)`` (AveragedModel's update) writes the
            # Parameter through an alias, which is another tensor object on the same memory.
            address, held = _memory_entry(tensor, written, origin)
            self._by_memory[address] = held
        if written and tensor._base is not None:
            # A write through a view wrote its base: a later view of that base, seen through a new object
            # (``q = q.t()`` after ``q /= q.sum(1)``, as autograd saved it), finds the origin there.
            self.note(tensor._base, origin, written)
        if len(origins) > 100_000:
            for key in [key for key, entry in origins.items() if entry[0]() is None]:
                del origins[key]
            self._by_ref.clear()  # (a check after this many non-finite tensors finds the freed ones no more)

    def note_view(self, view: torch.Tensor, origin: Origin | Benign) -> None:
        """A view's origin, by its weak reference alone (:meth:`entry` finds a live view's through its base): a
        check that finds the view freed has only its record's reference (Linear's 3-d output is a view of addmm's)."""
        ref = weakref.ref(view)
        self._by_ref[id(ref)] = (ref, origin, self._counted(view, origin))

    def _counted(self, tensor: torch.Tensor, origin: Origin | Benign) -> PendingCounts | None:
        """``tensor``'s counts on its device, read only where a boundary the deferred check finds freed is judged:
        where ``counting`` and an op's origin reached a possible forward boundary (made with grad enabled: a loss; a
        watched module's output), not a loop's ``no_grad`` metric (an entropy's absorbed ``0 * log 0``), nor a
        backward op's output (a gradient is counted as its hook records it: count_boundary). Else None."""
        if not (self.counting and isinstance(origin, Origin) and is_checkable_op_value(tensor)) or not (
                torch.is_grad_enabled() or (torch._C._current_graph_task_id() == -1 and self.in_module())):
            return None
        return PendingCounts(tensor, self.known(tensor))

    def count_boundary(self, tensor: torch.Tensor) -> None:
        """Count a gradient the watch's hook records, where ``counting`` and an op's origin reached it."""
        if self.counting and self._by_ref and (entry := self._by_ref.get(id(ref := weakref.ref(tensor)))) and (
                entry[0] is ref and entry[2] is None and isinstance(entry[1], Origin)
                and is_checkable_op_value(tensor)):
            self._by_ref[id(ref)] = (ref, entry[1], PendingCounts(tensor, self.known(tensor)))

    def note_memory(self, tensor: torch.Tensor, origin: Origin) -> None:
        """Note a forward origin by its output's memory alone, for a backward op that reads it saved."""
        if not tensor.is_inference() and type(tensor) in _PLAIN and dense(tensor):
            address, held = _memory_entry(tensor, False, origin)
            self._by_memory[address] = held


#: Finite values kept per tensor in an op's own samples: its histograms, a few per report.
OP_SAMPLE_SIZE = 1024


def op_samples(op: str, label: str, output: torch.Tensor, operands: list[tuple[str, Any]]) -> tuple[Sample, ...]:
    """Samples of an op's output and of its readable tensor operands (by schema name), while they live."""
    output_ref = TensorRef.op_output(op, label)
    samples = [sample_values(output, output_ref, OP_SAMPLE_SIZE)]
    for name, value in operands:
        if isinstance(value, torch.Tensor) and is_checkable_op_value(value):
            ref = TensorRef(TensorRole.OPERAND, name)
            samples.append(sample_values(value, ref, OP_SAMPLE_SIZE))
    return tuple(samples)


def _add_operands(finding: Finding, op: OpFinding, operands: list[tuple[TensorRef, torch.Tensor]]) -> None:
    """The copies of the op's operands still alive, and the stats at the op of those freed before the boundary
    where its value was claimed (a loss code's masked sum and count, freed by the deferred check)."""
    finding.inputs.extend(operands)
    alive = {ref for ref, _tensor in operands}
    finding.input_stats.extend((ref, stats) for ref, stats in op.input_stats if ref not in alive)


def apply_op_finding(
    finding: Finding, op: OpFinding, tensors: tuple[tuple[str, torch.Tensor], ...] = ()
) -> None:
    """Add what the op tracer knows: the op, the line, and for backward the forward line.

    For a backward op the report's ``source`` is the forward line that created
    the autograd node (the line to fix); the line that ran backward is in
    the notes. ``tensors`` are the tracer's copies of the op's output and
    inputs, used for histograms.
    """
    finding.op = op.op
    # The user's numbers (``logits / t``, t = 0.0): a backward op's finite ones are autograd's own (SqrtBackward's
    # 0.5); a non-finite one is the forward's number, saved (``x * inf``'s MulBackward).
    users = op.phase != Phase.BACKWARD or op.backward_code
    finding.numbers = [(name, value) for name, value in op.scalars if users or not math.isfinite(value)]
    if op.own_number is not None:  # (the non-finite number is torch's own, inside the function the line called)
        finding.numbers = [(name, value) for name, value in finding.numbers if math.isfinite(value)]
        finding.notes.append(Note.of("own-number", function=op.own_number))
    if op.log_edge is not None:  # (xlogy's infinities where its y was 0: explain/forward.py's _log reads them)
        function = op_function(op.op)
        finding.notes.append(Note.of("log-edge", function=function.removeprefix("special_"), count=op.log_edge,
                                     edge=LOG_EDGES[function]))
    if op.spread is not None:  # (a divisor a std, a variance or a norm made: explain/forward.py's _division reads it)
        finding.notes.append(Note.of("spread-divisor", spread=op.spread))
    # The tracer keeps the op's output, then its operands by schema name.
    operands = [(TensorRef(TensorRole.OPERAND, label), tensor) for label, tensor in tensors[1:]]
    if op.absorbed is not None:
        inner = op.absorbed
        finding.absorbed = AbsorbedOp(inner.op, inner.module, inner.source, inner.nan, inner.posinf, inner.neginf)
    if op.phase == Phase.BACKWARD and op.backward_code and op.source is not None:
        # A Python backward (a custom Function's) ran the op on its own line: that line is the one to fix.
        finding.source = op.source
        finding.autograd_node = op.autograd_node
        created = to_pairs(op.forward_source) if op.forward_source is not None else None
        finding.notes.append(Note.of("python-backward", op=op.op, node=op.autograd_node, created=created))
    elif op.phase == Phase.BACKWARD:
        finding.source = op.forward_source or op.source
        finding.autograd_node = op.autograd_node
        finding.notes.append(Note.of("autograd-backward", op=op.op, node=op.autograd_node))
    else:
        finding.source = op.source
    if op.module is not None and (finding.module is None or op.backward_code or (
            op.phase == Phase.BACKWARD and finding.tensor.role is TensorRole.PARAMETER_GRADIENT)):
        # Python backward code (a custom Function's backward, a gradient hook a module's forward registered) is
        # that module's code: the producer is it, not the module whose parameter gradient showed the value. So is
        # the module whose forward made a parameter's node from a child's parameter it read itself (``qr(
        # self.linear.weight)``, a tied ``x @ self.embed.weight.T``): the child that owns it never ran that code.
        if finding.module is not None and finding.module != op.module:
            finding.module_type = None  # (named again from the name: op_origins._name_type_and_model)
        finding.module = op.module
    elif op.module is None and not op.backward_code and (finding.tensor.role is TensorRole.PARAMETER_GRADIENT or (
            op.phase == Phase.BACKWARD and finding.tensor.role is TensorRole.OUTPUT_GRADIENT)) and (
            op.phase != Phase.BACKWARD or op.forward_source is not None):
        # A gradient formula whose node the code outside every module made (a WGAN-GP penalty's sqrt of the input
        # gradient, differentiated again; the double backward reaches the module whose input gradient showed it), or
        # the loop's update code after backward (``p.grad /= p.grad.norm()``): the producer, not the gradient's owner.
        finding.module, finding.module_type = None, None
    if op.inner_source is not None and (op.phase != Phase.BACKWARD or op.backward_code):
        # Where inside the library the op ran; for the autograd engine's own backward that is only whatever
        # called backward (torch's, or the optimizer hook a replay ran from), which says nothing.
        finding.notes.append(Note.of("inside", source=to_pairs(op.inner_source)))
    if finding.bad is None and finding.bad_stats is None:
        # Found by the op tracer itself: the op's own output and inputs.
        finding.inputs_finite = True
        if tensors:
            finding.bad = tensors[0][1]
            _add_operands(finding, op, operands)
        else:
            finding.bad_stats = op.output_stats
            finding.input_stats = list(op.input_stats)
            finding.samples.extend(op.samples)
    else:
        # Found by a replay of the producer module (or of its caller). The
        # op's output is what the report describes: the header's counts and
        # the cause are the op's (a float16 bmm made 2 +inf), not those of
        # the module output the check saw (64 nan after a softmax), which
        # stays beside it. The op's operands (named by schema argument:
        # ``self``, ``other``) say e.g. which one held the zeros.
        bad = finding.bad
        module_stats = finding.bad_stats if bad is None else tensor_stats(bad)
        if module_stats is not None:
            finding.module_output = (finding.tensor, module_stats, bad)
        finding.tensor = TensorRef.op_output(op.op, op.tensor)
        if tensors:
            finding.bad, finding.bad_stats = tensors[0][1], None
            _add_operands(finding, op, operands)
        else:
            finding.bad, finding.bad_stats = None, op.output_stats
            finding.input_stats.extend(op.input_stats)
            finding.samples.extend(op.samples)


def attach_origin(finding: Finding, origin: OpFinding) -> None:
    """Add the op that started a boundary's non-finite value to its finding.

    The event is the boundary tensor (the loss, a parameter, a gradient):
    the report keeps it and its counts, and the op adds its name, line and
    operands.
    """
    kept = finding.tensor, finding.bad, finding.bad_stats
    apply_op_finding(finding, origin)
    if not _counts_unknown(finding.module_output, origin):
        (finding.tensor, finding.bad, finding.bad_stats), finding.module_output = kept, None
    # else: the boundary's tensor is gone and its probe knows no counts (a gradient judged at the deferred check,
    # freed by then): the report describes the op's output, whose counts the tracer kept, and the boundary beside it.
    # The producer is now the op: whether its inputs were finite is the op's (a batch's finding said the batch
    # came in non-finite; the division the loop ran on it read finite values). A count of None is a kind present.
    finding.inputs_finite = not any(
        stats.nan != 0 or stats.posinf != 0 or stats.neginf != 0 for _ref, stats in origin.input_stats
    )


def _counts_unknown(boundary: tuple[TensorRef, TensorStats, torch.Tensor | None] | None, origin: OpFinding) -> bool:
    """Whether the boundary is known only by a probe that counted nothing, and the op's output counts are known."""
    if boundary is None or boundary[2] is not None or origin.output_stats is None:
        return False
    stats = boundary[1]
    return stats.nan is None or stats.posinf is None or stats.neginf is None
