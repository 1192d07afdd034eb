"""Op-level tracing: the aten op that first produced a non-finite value.

:class:`OpTracer` is a ``TorchDispatchMode``. It sees every aten op below
autograd, including the ops the autograd engine runs for a backward pass and
the foreach/fused kernels of optimizers, and it leaves fused fast paths alone
(a ``TorchFunctionMode`` would make ``nn.TransformerEncoderLayer`` skip its
inference fast path and so change what the model computes).

Speed comes from doing nothing for most ops:

- ops that cannot create a non-finite value from finite inputs (views, copies,
  indexing, selections such as ``relu``/``max``/``clamp``, comparisons, fills
  from a scalar) are passed through unchecked; a value they pass on is seen by
  the next op that is checked;
- a checked op's outputs get one fused ``torch.aminmax`` each (NaN propagates
  into both ends, ``+inf`` shows as the max, ``-inf`` as the min) and one read;
- only a non-finite output makes the tracer look at the op's inputs, and
  tensors whose kinds it already knows (same object, same version counter)
  are not looked at again.

The producer (PRODUCT.md) is the first op whose inputs were all finite or
benign and whose output holds a non-finite value. Its inputs are the tensors,
the scalar arguments, and for an in-place op the mutated tensor's value before
the op. The tracer keeps, for each non-finite tensor it sees, its *origin*:

- an op whose inputs are finite or benign and whose output is non-finite
  starts an origin (an :class:`OpFinding`);
- an op with a non-finite input that carries an origin inherits it (a
  propagator, even where it turns an inf into a NaN), and so does a passive op
  that passes such a value on (``cat``, ``where``, a widening copy; a view's
  origin is its base's);
- a *deliberate* infinity is benign: an op given an infinite scalar
  (``masked_fill(mask, -inf)``), or an infinite mask tensor that entered the
  traced code from outside (a float attention mask, argument or buffer). Its
  consumers stay benign while they only carry those infinities on; one that
  makes a new kind (softmax over a fully masked row: NaN) starts an origin. A
  NaN scalar is never deliberate: ``masked_fill(mask, nan)`` starts one.
- a non-finite input from outside the trace that is no mask (a NaN parameter,
  a bad batch) carries no origin: the watch's module-level rules name it.

An intermediate value that never reaches a boundary is no event: ``tanh``
absorbs an overflowed ``pow``. In ops mode (``at_boundary=True``) the watch
asks :meth:`OpTracer.claim` for the origin of a non-finite tensor at a
boundary (a module output, the loss, a gradient, a parameter) and reports
that op. A forward value that was absorbed there but is read again by a
backward op (``exp``'s saved output under ``torch.where``: ``0 * inf``) makes
that backward op an origin, with the forward op as its ``absorbed`` field.
Without ``at_boundary`` (a replay, which stops there to open %debug in that
op's frame) the first origin is the finding at once.
After a finding the tracer stops checking; :meth:`OpTracer.reset` re-arms it.

Ops run by nan_magic's own code (its hooks' reductions, the optimizer's
gradient norms) are never judged: an origin whose op was called from our
code is dropped.
"""

from __future__ import annotations

import functools
import linecache
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import Self

from nan_magic.engine.frames import is_library_file, pointer
from nan_magic.engine.masks import is_additive_mask
from nan_magic.engine.stats import (
    is_checkable,
    probe,
    probe_kinds,
    probe_stats,
    readable,
    relevant_kinds,
    tensor_stats,
)
from nan_magic.records import KINDS, Phase, SourcePointer, TensorStats

__all__ = ["OpFinding", "OpTracer", "user_frame"]


@dataclass(frozen=True)
class OpFinding:
    """The producer op: the first op whose output held a new non-finite kind.

    Attributes
    ----------
    op
        The aten overload, e.g. ``"aten.div.Tensor"``.
    phase
        ``forward``, ``backward`` (the op ran inside the autograd engine) or
        what the tracer's ``phase_hint`` said (``optimizer``).
    module
        What the tracer's ``module_name`` callable returned at the op; for a
        backward op, what it returned when the forward op that created the
        node ran.
    source
        The innermost frame that is the user's code (outside torch and
        nan_magic): the line that ran the op, ``loss.backward()`` or
        ``opt.step()``. ``None`` when no such frame is on the stack (a backward
        op on an autograd worker thread).
    inner_source
        The innermost Python frame below ``source`` that ran the op, e.g. in
        ``torch/nn/functional.py``; ``None`` when it is ``source`` itself.
    forward_source
        For a backward op, the user's line in the forward pass that created
        the autograd node being executed (see :class:`OpTracer`).
    autograd_node
        For a backward op, the name of that node, e.g. ``"SqrtBackward0"``.
    tensor
        Which output went bad: ``"output"``, ``"output[1]"``, or for an
        in-place op without a return value the mutated argument (``"self[3]"``).
    new_kinds
        The watched kinds the output held and no input held, in
        :data:`nan_magic.records.KINDS` order.
    nan, posinf, neginf, numel
        Counts of that output.
    output_stats
        Statistics of that output.
    input_stats
        ``(label, stats)`` of every tensor input, labelled by schema argument
        name (``"self"``, ``"other"``, ``"tensors[2]"``). The value of an
        in-place op's mutated tensor before the op is ``"self (before)"`` and
        is known only through its probe (counts of a present kind are None).
    scalars
        ``(name, value)`` of the numeric scalar arguments (``eps``, ``alpha``).
    absorbed
        For a backward op: the forward op whose non-finite output it read
        although that value never reached a boundary in forward (absorbed by
        ``torch.where`` or ``tanh``), e.g. ``exp`` for ``0 * inf`` in
        ``ExpBackward0``; None otherwise.
    """

    op: str
    phase: Phase
    module: str | None
    source: SourcePointer | None
    inner_source: SourcePointer | None
    forward_source: SourcePointer | None
    autograd_node: str | None
    tensor: str
    new_kinds: tuple[str, ...]
    nan: int
    posinf: int
    neginf: int
    numel: int
    output_stats: TensorStats
    input_stats: tuple[tuple[str, TensorStats], ...]
    scalars: tuple[tuple[str, float], ...]
    absorbed: OpFinding | None = None

    @property
    def dtype(self) -> str:
        """The bad output's dtype name, e.g. ``"float16"``."""
        return self.output_stats.dtype


def _no_module() -> str | None:
    return None


class OpTracer(TorchDispatchMode):
    """Find the producer op of the first non-finite value while active.

    Parameters
    ----------
    kinds
        Which kinds count: any of ``"nan"`` and ``"inf"`` (both signs).
    module_name
        Called at a finding; returns the qualified name of the module running
        (the watch keeps a module stack), or None.
    on_finding
        Called once, with the finding, inside the producing op (not with
        ``at_boundary``). It may raise to stop the program at that op; the
        exception leaves through the op (and, in backward, through
        ``loss.backward()``).
    phase_hint
        Called at a finding outside the autograd engine; a non-None phase
        (``Phase.OPTIMIZER`` while an optimizer steps) overrides ``forward``.
    at_boundary
        Record origins only; the finding is the origin that :meth:`claim`
        finds for a tensor at a boundary (ops mode). Without it, the first
        origin is the finding.
    outside_benign
        A non-finite value from outside the trace counts as benign: in a
        replay of a module that the watch found to be the producer, it is
        what the module received (e.g. a masked row's -inf). Otherwise only
        a mask-like one does, and any other carries no origin.

    Notes
    -----
    ``forward_source`` of a backward finding: autograd numbers the nodes it
    creates from a thread-local counter (``Node._sequence_nr()``), and an op's
    node is created just before the op is dispatched to this mode. So when
    ``torch._C._autograd._get_sequence_nr()`` has moved since the previous op,
    node ``counter - 1`` belongs to the current op, and the tracer records its
    user line (a code object and a line number, no frames kept). In backward,
    ``torch._C._current_autograd_node()._sequence_nr()`` looks that line up.
    This costs a counter read per op and a short stack walk per node created,
    unlike anomaly mode, which formats a full traceback per node. The most
    recent ``max_sources`` nodes are remembered.

    Examples
    --------
    >>> x = torch.ones(2, requires_grad=True)
    >>> with OpTracer() as tracer:
    ...     torch.sqrt(x - 1).sum().backward()
    >>> tracer.finding.op, tracer.finding.phase, tracer.finding.autograd_node
    ('aten.div.Tensor', <Phase.BACKWARD: 'backward'>, 'SqrtBackward0')
    """

    #: Higher-order operators (``torch.cond``, eager flex attention) reach
    #: ``__torch_dispatch__`` as one op instead of raising under this mode.
    supports_higher_order_operators = True

    def __init__(
        self,
        *,
        kinds: frozenset[str] = frozenset({"nan", "inf"}),
        module_name: Callable[[], str | None] = _no_module,
        on_finding: Callable[[OpFinding], None] | None = None,
        phase_hint: Callable[[], Phase | None] | None = None,
        max_sources: int = 200_000,
        at_boundary: bool = False,
        outside_benign: bool = False,
    ) -> None:
        super().__init__()
        kinds = frozenset(kinds)
        if not kinds or kinds - {"nan", "inf"}:
            raise ValueError(
                f"kinds must be a non-empty subset of {{'nan', 'inf'}}, not {sorted(kinds)!r}"
            )
        self.kinds = kinds
        self.finding: OpFinding | None = None
        #: ``(label, tensor)`` copies of the producer's output and live inputs
        #: (for histograms), kept until :meth:`reset`.
        self.producer_tensors: tuple[tuple[str, torch.Tensor], ...] = ()
        self._module_name = module_name
        self._on_finding = on_finding
        self._phase_hint = phase_hint
        self._max_sources = max_sources
        self.at_boundary = at_boundary
        #: Modules whose code made or carried on a deliberate infinity this step.
        self.benign_modules: set[str | None] = set()
        self.outside_benign = outside_benign
        # id(tensor) -> (weak reference, version, written in place, origin) of
        # the non-finite tensors seen (see the module docstring).
        self._origins: dict[int, tuple[weakref.ref[torch.Tensor], int, bool, _Origin | _Benign]] = {}
        # Forward origins by where their values live: autograd saves an op's
        # output for its backward as another tensor object on the same memory
        # (``exp`` saves its result), which a backward op then reads.
        self._by_memory: dict[tuple[Any, ...], tuple[int, _Origin | _Benign]] = {}
        # id(tensor) -> (weak reference, version counter, kinds) of tensors whose
        # kinds are known; the reference and version make stale ids harmless.
        self._known: dict[int, tuple[weakref.ref[torch.Tensor], int, frozenset[str]]] = {}
        # autograd sequence number -> (code, line) of the forward op that created it
        self._sources: dict[int, tuple[CodeType, int, str | None]] = {}
        self._seen_seq = 0
        self._last_location: tuple[CodeType, int, str | None] | None = None
        self._lock = threading.Lock()
        #: Every origin started this step, in execution order (a replay cut short by an exception
        #: reports the first).
        self.started: list[OpFinding] = []
        # id(origin finding) -> weak (label, tensor) of its output and inputs, for histograms.
        self._witnesses: dict[int, tuple[tuple[str, weakref.ref[torch.Tensor]], ...]] = {}
        # id(forward origin finding) -> the user's frame that ran the op, for %debug (cleared each step).
        self._frames: dict[int, tuple[FrameType, tuple[int, int]]] = {}
        # Set by replay: called with each tensor an op is about to write, even
        # by a passive op or after the finding.
        self._before_write: Callable[[torch.Tensor], None] | None = None
        #: The autograd graph task whose ops count as forward ops: set by a
        #: replay that runs a forward inside a gradient hook (-1: none).
        self.forward_task = -1

    def reset(self, origins: bool = True) -> None:
        """Forget the finding and check again; with ``origins``, forget the origins too (a new step)."""
        self.finding = None
        self.producer_tensors = ()
        if origins:
            self.started.clear()
            self._origins.clear()
            self._by_memory.clear()
            self._witnesses.clear()
            self._frames.clear()
            self.benign_modules.clear()

    def origin_of(self, tensor: torch.Tensor) -> OpFinding | Literal["benign"] | None:
        """The op that started ``tensor``'s non-finite values, ``"benign"``, or None (from outside)."""
        entry = self._origin_entry(tensor)
        if isinstance(entry, _Origin):
            return entry.finding
        return "benign" if entry is not None else None

    def claim(self, tensor: torch.Tensor) -> OpFinding | Literal["benign"] | None:
        """:meth:`origin_of` a non-finite tensor at a boundary, made the finding when it is an op.

        The tracer then stops checking until :meth:`reset`, and
        :attr:`producer_tensors` holds copies of the op's output and inputs
        that are still alive.
        """
        origin = self.origin_of(tensor)
        if isinstance(origin, OpFinding) and self.finding is None:
            with self._lock:
                self.finding = origin
                self.producer_tensors = self._witnessed(origin)
        return origin

    def __enter__(self) -> Self:
        # Tensors may have changed outside the trace without our knowledge.
        self._known.clear()
        # Nodes created before the trace began are not ours to name.
        self._seen_seq = torch._C._autograd._get_sequence_nr()
        self._last_location = None
        super().__enter__()
        return self

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        task = torch._C._current_graph_task_id()
        in_backward = task != -1 and task != self.forward_task
        if not isinstance(func, torch._ops.OpOverload):
            return self._opaque(func, args, kwargs, in_backward)
        plan = _plan(func)
        if not in_backward:
            self._note_node(plan, args, kwargs)
        if plan.writes and self._before_write is not None:
            for _, tensor in _tensors(plan, args, kwargs, plan.writes):
                self._before_write(tensor)
        if self.finding is not None:
            return func(*args, **kwargs)
        if plan.passive and not (plan.fills and _odd_scalar(plan, args, kwargs)):
            out = func(*args, **kwargs)
            if self._origins and not plan.view:
                self._carry(plan, args, kwargs, out)
            return out
        priors = self._probe_priors(plan, args, kwargs) if plan.writes else {}
        out = func(*args, **kwargs)
        if plan.writes:
            # Autograd bumps the version counter only after the op returns
            # here, so a cached entry for a written tensor still looks current.
            for _, written in _tensors(plan, args, kwargs, plan.writes):
                self._known.pop(id(written), None)
        if plan.conversion and not _narrows(plan, args, kwargs, out):
            if self._origins:  # a widening copy (``.float()``) passes its input's origin on
                self._carry(plan, args, kwargs, out)
            return out
        outputs = list(_flatten("output", out))
        if plan.writes and not outputs:
            outputs = list(_tensors(plan, args, kwargs, plan.writes))
        bad = self._suspects(outputs)
        if bad:

            def inputs_of(label: str) -> list[tuple[str, Any]]:
                index = _list_index(label) if plan.per_index else None
                return list(_inputs(plan, args, kwargs, index))

            in_place = frozenset(id(t) for _, t in _tensors(plan, args, kwargs, plan.writes)) if plan.writes else None
            self._examine(_op_name(func), bad, inputs_of, priors, in_backward, in_place)
        return out

    def _opaque(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], in_backward: bool
    ) -> Any:
        """A higher-order operator (``torch.cond``) is checked as one op.

        The ops inside it run without this mode, so they are not seen.
        """
        out = func(*args, **kwargs)
        if self.finding is None:
            leaves = tree_leaves((args, kwargs))
            inputs = [
                (f"operand[{index}]", value)
                for index, value in enumerate(leaves)
                if isinstance(value, torch.Tensor) or _is_number(value)
            ]
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            bad = self._suspects(list(_flatten("output", outputs)))
            if bad:
                name = f"higher_order.{func.name()}"
                self._examine(name, bad, lambda _label: inputs, {}, in_backward, None)
        return out

    # -- forward line of autograd nodes ----------------------------------------

    def _note_node(self, plan: _Plan, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        seq = torch._C._autograd._get_sequence_nr()
        if seq == self._seen_seq:
            return
        # A node or two at most comes between two ops; a long gap is nodes
        # made outside this thread's forward (a backward with create_graph).
        first = max(self._seen_seq, seq - 8)
        self._seen_seq = seq
        frame = user_frame(sys._getframe(2))
        location = (frame.f_code, frame.f_lineno, self._module_name()) if frame is not None else None
        sources = self._sources
        own = torch.is_grad_enabled() and any(
            t.requires_grad for _, t in _tensors(plan, args, kwargs, plan.reads)
        )
        if own:
            # This op's node is the newest; older new nodes were made after the
            # previous op was dispatched, by its autograd wrapper (CopySlices
            # of an in-place op on a view).
            if location is not None:
                sources[seq - 1] = location
            if self._last_location is not None:
                for key in range(first, seq - 1):
                    sources[key] = self._last_location
        elif location is not None:
            # Nodes made since the previous op and none by this one: a custom
            # autograd.Function, whose forward this op runs in.
            for key in range(first, seq):
                sources[key] = location
        self._last_location = location
        if len(sources) > self._max_sources:
            # Keys were inserted in increasing order: drop the oldest half.
            for key in list(sources)[: len(sources) // 2]:
                del sources[key]

    def _forward_source(self, node: Any) -> tuple[SourcePointer | None, str | None]:
        """The forward line that created ``node``, and the module it ran in."""
        entry = self._sources.get(node._sequence_nr()) if node is not None else None
        if entry is None:
            return None, None
        code, lineno, module = entry
        line = linecache.getline(code.co_filename, lineno).strip() or None
        return SourcePointer(code.co_filename, lineno, code.co_name, line), module

    # -- kinds of tensors --------------------------------------------------------

    def _known_kinds(self, tensor: torch.Tensor) -> frozenset[str] | None:
        entry = self._known.get(id(tensor))
        if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
            return entry[2]
        return None

    def _remember(self, tensor: torch.Tensor, kinds: frozenset[str]) -> None:
        if tensor.is_inference():
            return  # no version counter: a later in-place change would go unseen
        known = self._known
        known[id(tensor)] = (weakref.ref(tensor), tensor._version, kinds)
        if len(known) > 100_000:
            for key in [key for key, entry in known.items() if entry[0]() is None]:
                del known[key]

    def _probe_priors(
        self, plan: _Plan, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> dict[int, _Prior]:
        """Probe, before the op, every input whose value the op overwrites.

        That is the written tensor of an in-place op, and any input sharing
        its storage (``torch.add(a, b, out=a)``). A probe is an ``aminmax``
        whose result is read only if the output turns out non-finite; a
        tensor whose kinds are known costs nothing.
        """
        if plan.overwrites:
            return {}
        # Only dense tensors have a storage to compare (a sparse one's values are its own).
        written = [t for _, t in _tensors(plan, args, kwargs, plan.writes) if is_checkable(t) and _dense(t)]
        storages = {t.untyped_storage().data_ptr() for t in written}
        priors: dict[int, _Prior] = {}
        for _, tensor in _tensors(plan, args, kwargs, plan.reads):
            if is_checkable(tensor) and _dense(tensor) and tensor.untyped_storage().data_ptr() in storages:
                kinds = self._known_kinds(tensor)
                probed = probe(_wide(readable(tensor))) if kinds is None else None
                origin = self._origin_entry(tensor) if self._origins else None
                priors[id(tensor)] = _Prior(tensor.dtype, tuple(tensor.shape), kinds, probed, origin)
        return priors

    def _suspects(self, outputs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The outputs that may be non-finite; the others are remembered as finite."""
        checked = [(label, t) for label, t in outputs if is_checkable(t)]
        if not checked:
            return []
        suspects = []
        for (label, tensor), total in zip(checked, _read([_sum(t) for _, t in checked])):
            if math.isfinite(total):
                self._remember(tensor, frozenset())
            else:
                suspects.append((label, tensor))
        return suspects

    def _kinds(self, tensor: torch.Tensor) -> frozenset[str]:
        """Exact kinds of a live tensor, from the cache where possible."""
        known = self._known_kinds(tensor)
        if known is None:
            # A complex value is non-finite where its real or imaginary part is (stats.values_to_read).
            known = _exact_kinds(tensor) if is_checkable(tensor) else frozenset()
            self._remember(tensor, known)
        return known

    # -- a non-finite output ---------------------------------------------------

    def _examine(
        self,
        op: str,
        bad: list[tuple[str, torch.Tensor]],
        inputs_of: Callable[[str], list[tuple[str, Any]]],
        priors: dict[int, _Prior],
        in_backward: bool,
        written: frozenset[int] | None,
    ) -> None:
        """Give each non-finite output its origin: inherited, benign, none, or this op.

        ``written``: ids of the tensors the op writes in place, if any.
        """
        for label, tensor in bad:
            out_kinds = relevant_kinds(self._kinds(tensor), self.kinds)
            if not out_kinds:
                continue
            inputs = inputs_of(label)
            inherited: _Origin | None = None
            absorbed: _Origin | None = None
            held: set[str] = set()
            benign: set[str] = set()
            outside = False
            for _, value in inputs:
                if not isinstance(value, torch.Tensor):
                    kinds = _scalar_kinds(value)
                    held |= kinds
                    benign |= kinds - {"nan"}  # a NaN scalar is never a deliberate infinity
                    continue
                prior = priors.get(id(value))
                kinds = relevant_kinds(prior.kinds() if prior is not None else self._kinds(value), self.kinds)
                if not kinds:
                    continue
                held |= kinds
                entry = prior.origin if prior is not None else self._origin_entry(value)
                if entry is None and in_backward and self._by_memory:
                    # A forward value autograd saved has lost its Python object: found by its memory.
                    entry = self._memory_origin(value)
                if isinstance(entry, _Origin):
                    if in_backward and entry.finding.phase != Phase.BACKWARD:
                        # A forward value read by a gradient formula, which reached no
                        # forward boundary (it would have been reported there).
                        absorbed = absorbed or entry
                    else:
                        inherited = entry
                        break  # the output carries this origin: the other inputs change nothing
                elif entry is not None or self.outside_benign:
                    benign |= kinds
                elif "nan" not in kinds and is_additive_mask(value):
                    benign |= kinds
                    self._note_origin(value, _BENIGN)  # looked at once per step, not at every consumer
                else:
                    outside = True
            in_place = written is not None and id(tensor) in written
            if inherited is not None:
                self._note_origin(tensor, inherited, in_place)
            elif outside:
                continue  # a propagator of a value from outside the trace: the watch's own rules
            elif out_kinds <= benign:
                self._note_origin(tensor, _BENIGN, in_place)
                if not in_backward:
                    self.benign_modules.add(self._module_name())
            elif not _called_by_us():
                new = frozenset(out_kinds - held) or out_kinds
                origin = self._start_origin(op, label, tensor, new, inputs, priors, in_backward, absorbed)
                self._note_origin(tensor, origin, in_place)
                self._report(origin)
            if self.finding is not None:
                return

    def _start_origin(
        self,
        op: str,
        label: str,
        tensor: torch.Tensor,
        new: frozenset[str],
        inputs: list[tuple[str, Any]],
        priors: dict[int, _Prior],
        in_backward: bool,
        absorbed: _Origin | None,
    ) -> _Origin:
        """An origin: this op made ``tensor`` non-finite from finite or benign inputs."""
        node = torch._C._current_autograd_node() if in_backward else None
        phase = Phase.BACKWARD if in_backward else None
        if phase is None and self._phase_hint is not None:
            phase = self._phase_hint()
        source, inner, user_frame = _sources_of_op(sys._getframe(1))
        output_stats = tensor_stats(tensor)
        input_stats = []
        witnesses = [(label, weakref.ref(tensor))]
        for name, value in inputs:
            if not isinstance(value, torch.Tensor):
                continue
            prior = priors.get(id(value))
            if prior is not None:
                input_stats.append((f"{name} (before)", prior.stats()))
            elif is_checkable(value):
                input_stats.append((name, tensor_stats(value)))
                witnesses.append((name, weakref.ref(value)))
        forward_source, forward_module = self._forward_source(node)
        finding = OpFinding(
            op=op,
            phase=phase or Phase.FORWARD,
            module=forward_module if in_backward else self._module_name(),
            source=source,
            inner_source=inner,
            forward_source=forward_source,
            autograd_node=node.name() if node is not None else None,
            tensor=label,
            new_kinds=tuple(kind for kind in KINDS if kind in new),
            nan=output_stats.nan or 0,
            posinf=output_stats.posinf or 0,
            neginf=output_stats.neginf or 0,
            numel=output_stats.numel,
            output_stats=output_stats,
            input_stats=tuple(input_stats),
            scalars=tuple((name, value) for name, value in inputs if isinstance(value, (int, float))),
            absorbed=absorbed.finding if absorbed is not None else None,
        )
        self._witnesses[id(finding)] = tuple(witnesses)
        self.started.append(finding)
        if not in_backward and user_frame is not None:
            # The frame runs on after the op: where it was then is where %debug opens.
            self._frames[id(finding)] = (user_frame, (user_frame.f_lasti, user_frame.f_lineno))
        origin = _Origin(finding)
        if not in_backward and not tensor.is_inference() and type(tensor) in _PLAIN and _dense(tensor):
            self._by_memory[_memory_key(tensor)] = (tensor._version, origin)
        return origin

    def _report(self, origin: _Origin) -> None:
        """Without ``at_boundary``, the first origin is the finding, reported inside its op."""
        if self.at_boundary:
            return
        with self._lock:
            if self.finding is not None:
                return
            self.finding = origin.finding
            self.producer_tensors = self._witnessed(origin.finding)
        if self._on_finding is not None:
            self._on_finding(origin.finding)

    def frame_of(self, finding: OpFinding) -> tuple[FrameType | None, tuple[int, int] | None]:
        """The user's frame that ran a forward origin's op, and its ``(f_lasti, f_lineno)`` then; for ``%debug``."""
        return self._frames.get(id(finding), (None, None))

    def _witnessed(self, finding: OpFinding) -> tuple[tuple[str, torch.Tensor], ...]:
        """Copies of the op's output, then of its inputs still alive; none when the output is gone.

        An intermediate output is often freed by the boundary where it is
        claimed: the finding's statistics then stand for it and its inputs.
        """
        alive = [(label, ref()) for label, ref in self._witnesses.get(id(finding), ())]
        if not alive or alive[0][1] is None:
            return ()
        return tuple((label, tensor.detach().clone()) for label, tensor in alive if tensor is not None)

    # -- origins -----------------------------------------------------------------

    def _origin_entry(self, tensor: torch.Tensor) -> _Origin | _Benign | None:
        """The origin noted for ``tensor``, or for the tensor it is a view of (views are not carried)."""
        entry = self._origins.get(id(tensor))
        if entry is not None and entry[0]() is not tensor:
            entry = None  # a dead tensor's entry under a reused id: it must not hide the base's
        if entry is None and tensor._base is not None:
            entry = self._origins.get(id(tensor._base))
            tensor = tensor._base
        if entry is None or entry[0]() is not tensor:
            # An op's output that only C++ held (inside matmul) lost its Python
            # object, and the view of it is seen through a new one: by memory.
            return self._memory_origin(tensor)
        # Autograd bumps the version of a tensor written in place after the
        # op returns here: such an entry holds for the version before or after.
        if tensor._version - entry[1] not in ((0, 1) if entry[2] else (0,)):
            return None
        return entry[3]

    def _memory_origin(self, tensor: torch.Tensor) -> _Origin | _Benign | None:
        if not self._by_memory or tensor.is_inference() or type(tensor) not in _PLAIN or not _dense(tensor):
            return None
        entry = self._by_memory.get(_memory_key(tensor))
        return entry[1] if entry is not None and entry[0] == tensor._version else None

    def _note_origin(self, tensor: torch.Tensor, origin: _Origin | _Benign, written: bool = False) -> None:
        if tensor.is_inference():
            return  # no version counter
        origins = self._origins
        origins[id(tensor)] = (weakref.ref(tensor), tensor._version, written, origin)
        if not written and type(tensor) in _PLAIN and _dense(tensor):  # a sparse tensor has no one storage
            self._by_memory[_memory_key(tensor)] = (tensor._version, origin)
        if len(origins) > 100_000:
            for key in [key for key, entry in origins.items() if entry[0]() is None]:
                del origins[key]

    def _carry(self, plan: _Plan, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """A passive op passes its input's origin on to its outputs (a view, ``cat``, ``where``).

        A carried origin counts only where the output is non-finite (it is
        looked up only for such a tensor), so one carried to a finite output
        is harmless.
        """
        for _, tensor in _tensors(plan, args, kwargs, plan.reads):
            entry = self._origin_entry(tensor)
            if entry is not None:
                break
        else:
            return
        for _, output in _flatten("output", out):
            self._note_origin(output, entry)
        for _, written in _tensors(plan, args, kwargs, plan.writes):
            self._note_origin(written, entry, written=True)


# -- what an op does, from its schema (computed once per overload) --------------

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

# Copies that are passive unless they narrow the dtype (float32 -> float16
# overflows to inf); value: the argument holding the source.
_CONVERSIONS = {
    "copy_": "src",
    "copy": "src",
    "_to_copy": "self",
    "_copy_from": "self",
    "_copy_from_and_resize": "self",
}

# In-place ops that overwrite their target without reading it.
_OVERWRITES = frozenset(
    {"copy_", "_copy_from", "_copy_from_and_resize", "normal_", "uniform_", "log_normal_",
     "exponential_", "geometric_", "cauchy_", "random_", "_foreach_copy_"}
)


@dataclass(frozen=True)
class _Plan:
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


@functools.cache
def _plan(func: torch._ops.OpOverload) -> _Plan:
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
    return _Plan(
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
    )


def _arguments(
    plan: _Plan, args: Sequence[Any], kwargs: dict[str, Any]
) -> Iterator[tuple[str, Any]]:
    yield from zip(plan.names, args)
    yield from kwargs.items()


def _tensors(
    plan: _Plan, args: Sequence[Any], kwargs: dict[str, Any], names: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, value in _arguments(plan, args, kwargs):
        if name in names:
            yield from _flatten(name, value)


def _inputs(
    plan: _Plan, args: Sequence[Any], kwargs: dict[str, Any], index: int | None
) -> Iterator[tuple[str, Any]]:
    """``(label, value)`` of the tensors and numeric scalars an op reads.

    For a foreach op only element ``index`` of each list argument is an input
    of output ``index``.
    """
    for name, value in _arguments(plan, args, kwargs):
        if name not in plan.reads:
            continue
        if isinstance(value, (list, tuple)):
            pairs = list(enumerate(value))
            if index is not None and len(value) > index:
                pairs = [(index, value[index])]
            for position, item in pairs:
                if isinstance(item, torch.Tensor) or (name in plan.numbers and _is_number(item)):
                    yield f"{name}[{position}]", item
        elif isinstance(value, torch.Tensor) or (name in plan.numbers and _is_number(value)):
            yield name, value


def _flatten(label: str, value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield label, value
    elif isinstance(value, (list, tuple)):
        single = label == "output" and len(value) == 1
        for position, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                yield (label if single else f"{label}[{position}]"), item


def _list_index(label: str) -> int | None:
    if label.endswith("]"):
        return int(label[label.rindex("[") + 1 : -1])
    return None


def _dense(tensor: torch.Tensor) -> bool:
    return tensor.layout is torch.strided


#: Tensor types whose memory can stand for a tensor whose Python object is gone (origins by memory).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


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


def _narrows(plan: _Plan, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> bool:
    """Whether a copy can overflow: a source range wider than the target's."""
    source = dict(_arguments(plan, args, kwargs)).get(plan.conversion or "")
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


def _exact_kinds(tensor: torch.Tensor) -> frozenset[str]:
    low, high = _read(list(probe(_wide(readable(tensor)))))
    kinds = probe_kinds(low, high)
    # NaN hides infinities from a probe; count them apart.
    return tensor_stats(tensor).kinds if "nan" in kinds else kinds


def _read(ends: list[torch.Tensor]) -> list[float]:
    """Read 0-d tensors to the host with one synchronisation."""
    if ends[0].device.type == "cpu":
        # No synchronisation to save; stacking would cost more than reading.
        return [end.item() for end in ends]
    if any(end.dtype != ends[0].dtype for end in ends):
        ends = [end.float() for end in ends]
    return torch.stack(ends).tolist()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _memory_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
            tensor.dtype, tensor.device)


def _odd_scalar(plan: _Plan, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a passive op was given a non-finite fill value (``masked_fill(mask, nan)``)."""
    return any(
        name in plan.fills and isinstance(value, float) and not math.isfinite(value)
        for name, value in _arguments(plan, args, kwargs)
    )


@dataclass(frozen=True)
class _Origin:
    """A non-finite value started by an op (its finding)."""

    finding: OpFinding


class _Benign:
    """A non-finite value that is a deliberate infinity (a mask, an infinite fill), or carries one."""


_BENIGN = _Benign()


def _scalar_kinds(value: Any) -> frozenset[str]:
    if not isinstance(value, float) or math.isfinite(value):
        return frozenset()
    if math.isnan(value):
        return frozenset({"nan"})
    return frozenset({"+inf" if value > 0 else "-inf"})


@dataclass(frozen=True)
class _Prior:
    """What was known of a tensor's value before an in-place op wrote it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    known: frozenset[str] | None
    probed: tuple[torch.Tensor, torch.Tensor] | None
    origin: _Origin | _Benign | None = None

    def kinds(self) -> frozenset[str]:
        if self.known is not None:
            return self.known
        assert self.probed is not None
        low, high = (float(v) for v in self.probed)
        kinds = probe_kinds(low, high)
        # NaN hides infinities, and the value is gone: assume it held them
        # too, so that an op is never blamed for a kind it may have passed on.
        return kinds | {"+inf", "-inf"} if "nan" in kinds else kinds

    def stats(self) -> TensorStats:
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


def _op_name(func: torch._ops.OpOverload) -> str:
    return f"{func.namespace}.{func.overloadpacket.__name__}.{func._overloadname}"


# -- frames ------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# nan_magic's own files, and torch's machinery between a Python call and a
# dispatch mode: a frame there is never the line that ran an op.
_PLUMBING = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    *(
        _TORCH_DIR + path
        for path in ("_ops.py", "utils/_python_dispatch.py", "_tensor.py", "overrides.py",
                     "autograd/__init__.py", "autograd/graph.py", "_dynamo", "_compile.py")
    ),
)

# id(code) -> (code, is library code); holding the code keeps its id unique.
_LIBRARY_CODE: dict[int, tuple[CodeType, bool]] = {}


def _is_library_code(code: CodeType) -> bool:
    entry = _LIBRARY_CODE.get(id(code))
    if entry is None:
        entry = _LIBRARY_CODE[id(code)] = (code, is_library_file(code.co_filename))
    return entry[1]


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame at or above ``frame`` that is the user's code (not torch's, not ours)."""
    # A tensor subclass's __torch_function__ is how the op was routed, not the
    # line that asked for it: that is the caller's (it stays the inner source).
    while frame is not None and (_is_library_code(frame.f_code) or frame.f_code.co_name in _SUBCLASS_HOOKS):
        frame = frame.f_back
    return frame


_SUBCLASS_HOOKS = frozenset({"__torch_function__", "__torch_dispatch__"})


def _is_plumbing(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    return os.path.abspath(filename).startswith(_PLUMBING) or filename.endswith(
        ("contextlib.py", "functools.py")
    )


_THIS_FILE = os.path.abspath(__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(_THIS_FILE)) + os.sep
# Our files that call the user's code: the wrapped Tensor.backward, a replay running a module
# (whose ops are the module's, even an nn.Linear's), a replayed step and its backward, and the
# recorded ops of the code outside the models, run again.
_RUNS_USER_CODE = tuple(
    os.path.join(_OWN_DIR, "engine", name)
    for name in ("backward_patch.py", "replay.py", "step_replay.py", "outside.py")
)


def _called_by_us() -> bool:
    """Whether the current op was called by nan_magic's own code (a hook's reduction, a norm).

    The innermost frame outside torch and this tracer decides; the autograd
    engine runs the user's backward with no such frame, or below our wrapped
    ``Tensor.backward``.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename == _THIS_FILE or filename.startswith(_TORCH_DIR) or filename.endswith(
            ("contextlib.py", "functools.py")
        ):
            frame = frame.f_back
            continue
        return filename.startswith(_OWN_DIR) and filename not in _RUNS_USER_CODE
    return False


def _sources_of_op(
    frame: FrameType | None,
) -> tuple[SourcePointer | None, SourcePointer | None, FrameType | None]:
    """The user's line that ran the current op, the innermost line below it, and the user's frame."""
    while frame is not None and _is_plumbing(frame):
        frame = frame.f_back
    user = user_frame(frame)
    if frame is None:
        return None, None, None
    if user is None:
        return None, pointer(frame), None
    return pointer(user), (pointer(frame) if frame is not user else None), user
