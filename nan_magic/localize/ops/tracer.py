"""Op-level tracing: the aten op that first produced a non-finite value.

:class:`OpTracer` is a ``TorchDispatchMode``. It sees every aten op below autograd, including the ops the
autograd engine runs for a backward pass and the foreach/fused kernels of optimizers, and it leaves fused fast
paths alone (a ``TorchFunctionMode`` would make ``nn.TransformerEncoderLayer`` skip its inference fast path and
so change what the model computes).

Speed comes from doing nothing for most ops:

- ops that cannot create a non-finite value from finite inputs (views, copies, indexing, selections such as
  ``relu``/``max``/``clamp``, comparisons, fills from a scalar) are passed through unchecked; a value they pass
  on is seen by the next op that is checked;
- a checked op's outputs get one fused ``torch.aminmax`` each (NaN propagates into both ends, ``+inf`` shows as
  the max, ``-inf`` as the min) and one read;
- only a non-finite output makes the tracer look at the op's inputs, and tensors whose kinds it already knows
  (same object, same version counter) are not looked at again.

The producer (PRODUCT.md) is the first op whose inputs were all finite or benign and whose output holds a
non-finite value. Its inputs are the tensors, the scalar arguments, and for an in-place op the mutated tensor's
value before the op. The tracer keeps, for each non-finite tensor it sees, its *origin*:

- an op whose inputs are finite or benign and whose output is non-finite starts an origin (an :class:`OpFinding`);
- an op with a non-finite input that carries an origin inherits it (a propagator, even where it turns an inf into
  a NaN; of several, the first born), and so does a passive op that passes such a value on (``cat``, ``where``, a
  widening copy; a view's origin is its base's, and a write of finite values into part of a tensor through a view,
  ``pad_sequence``'s copies into its ``full(nan)``, leaves the rest's origin as it was);
- a *deliberate* infinity is benign: an op given an infinite scalar (``masked_fill(mask, -inf)``), or an
  infinite mask tensor that entered the traced code from outside (a float attention mask, argument or buffer).
  Its consumers stay benign while they only carry those infinities on; one that makes a new kind (softmax over a
  fully masked row: NaN) starts an origin. A NaN scalar is never deliberate: ``masked_fill(mask, nan)`` starts one.
  What an index picks of a mask (``log_probs.gather(1, action)`` of a masked action) or a max reduces of it (a
  fully masked row's -inf) stays benign, noted as the pick's (:class:`~nan_magic.localize.ops.origins.Picked`); a
  sum that adds it up, or a consumer that makes a new kind of it, names the pick or the max instead of itself, but
  a softmax or logsumexp (the mask's own consumer) and a product by zero (masking by multiplication) stay named.
- a non-finite input from outside the trace that is no mask (a NaN parameter, a bad batch) carries no origin:
  the watch's module-level rules name it.

An intermediate value that never reaches a boundary is no event: ``tanh`` absorbs an overflowed ``pow``. In
ops mode (``at_boundary=True``) the watch asks :meth:`OpTracer.claim` for the origin of a non-finite tensor at a
boundary (a module output, the loss, a gradient, a parameter) and reports that op. A forward value that was
absorbed there but is read again by a backward op (``exp``'s saved output under ``torch.where``: ``0 * inf``)
makes that backward op an origin, with the forward op as its ``absorbed`` field. The replays claim at a boundary
too (a module call's output, the loss code's value, a refetched sample), else :meth:`OpTracer.claim_earliest`
takes the first origin. Without ``at_boundary`` the first origin is the finding at once.
After a finding the tracer stops checking; :meth:`OpTracer.reset` re-arms it.

Ops run by nan_magic's own code (its hooks' reductions, the optimizer's gradient norms) are never judged: an origin
whose op was called from our code is dropped.

This module is the dispatch mode and the rules above; its parts live beside it:
:mod:`~nan_magic.localize.ops.plans` (what an op does, from its schema), :mod:`~nan_magic.localize.ops.kinds`
(reading kinds cheaply, once per tensor), :mod:`~nan_magic.localize.ops.origins` (:class:`OpFinding` and the
origins table), :mod:`~nan_magic.localize.ops.sources` (the user's line of an op) and
:mod:`~nan_magic.localize.ops.witnesses` (an origin's tensors and frame); the rules themselves (an op starts, inherits
or carries an origin) are :mod:`~nan_magic.localize.ops.origin_rules`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from typing_extensions import Self

from nan_magic.localize.ops.derived import ModelDerived
from nan_magic.localize.ops.kinds import KnownKinds, probe_priors
from nan_magic.localize.ops.origin_rules import OriginRules
from nan_magic.localize.ops.origins import BENIGN, OpFinding, Origin, Origins
from nan_magic.localize.ops.plans import (
    Plan,
    flatten,
    is_number,
    list_positions,
    literal_numbers,
    narrows,
    odd_scalar,
    op_inputs,
    op_name,
    plan_of,
    run_op,
    tensors,
)
from nan_magic.localize.ops.reached import after_op
from nan_magic.localize.ops.sources import (
    NodeSources,
    called_by_us,
    recomputing,
)
from nan_magic.localize.ops.witnesses import OpWitnesses
from nan_magic.records import Phase, TensorRef, TensorStats

__all__ = ["OpTracer"]

#: make_fx's tracing mode, when one is on (lifecycle/users_modes._Traced): the values it traces cannot be read.
_get_mode, _PROXY = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.PROXY


def _no_module() -> str | None:
    return None


class OpTracer(OriginRules, TorchDispatchMode):
    """Find the producer op of the first non-finite value while active.

    ``kinds``: any of ``"nan"`` and ``"inf"`` (both signs). ``module_name()`` is called at a finding: the
    qualified name of the module running (the watch keeps a module stack), or None. ``on_finding`` is called once,
    with the finding, inside the producing op (not with ``at_boundary``): it may raise to stop the program there,
    through the op (and, in backward, through ``loss.backward()``). ``phase_hint()``, called at a finding outside
    the autograd engine, overrides ``forward`` with a non-None phase (``Phase.OPTIMIZER`` while an optimizer
    steps). With ``at_boundary`` (ops mode) origins are only recorded and the finding is the origin :meth:`claim`
    finds for a tensor at a boundary; without it, the first origin is the finding. With ``outside_benign`` (a
    replay of a module the watch found to be the producer) a non-finite value from outside the trace is what the
    module received (a masked row's -inf) and counts as benign; otherwise only a mask-like one does.

    A backward finding's ``forward_source`` is the user's line that created the autograd node being executed,
    noted while the forward ran by :class:`~nan_magic.localize.ops.sources.NodeSources` (a counter read per op,
    a short stack walk per node created).

    Examples
    --------
    >>> x = torch.ones(2, requires_grad=True)
    >>> with OpTracer() as tracer:
    ...     torch.sqrt(x - 1).sum().backward()
    >>> tracer.finding.op, tracer.finding.phase, tracer.finding.autograd_node
    ('aten.div.Tensor', <Phase.BACKWARD: 'backward'>, 'SqrtBackward0')
    """

    #: Higher-order operators (``torch.cond``, eager flex attention) reach ``__torch_dispatch__`` as one op.
    supports_higher_order_operators = True

    def __init__(
        self,
        *,
        kinds: frozenset[str] = frozenset({"nan", "inf"}),
        module_name: Callable[[], str | None] = _no_module,
        on_finding: Callable[[OpFinding], None] | None = None,
        phase_hint: Callable[[], Phase | None] | None = None,
        at_boundary: bool = False,
        outside_benign: bool = False,
        counting: bool = False,
    ) -> None:
        super().__init__()
        self.kinds = frozenset(kinds)  # checked by WatchConfig
        self.finding: OpFinding | None = None
        #: ``(label, tensor)`` copies of the producer's output and live inputs (histograms), kept until :meth:`reset`.
        self.producer_tensors: tuple[tuple[str, torch.Tensor], ...] = ()
        self._module_name = module_name
        self._on_finding = on_finding
        self._phase_hint = phase_hint
        self.at_boundary = at_boundary
        #: Modules whose code made or carried on a deliberate infinity this step.
        self.benign_modules: set[str | None] = set()
        self.outside_benign = outside_benign
        # The origin of each non-finite tensor seen (see the module docstring); ``counting`` (ops mode, deferred):
        # with the exact statistics of each tensor an origin reached, for a boundary freed by the check (freed_stats).
        self._origins = Origins()
        self._origins.counting = counting
        # The kinds of tensors already read, so that none is read twice.
        self._known = self.known = KnownKinds()  # (known: read by the loss code's data check, gradient_checks.py)
        self._origins.known, self._origins.in_module = self._known.get, self._in_module
        #: The user's forward line of each autograd node the traced forward creates.
        self.node_sources = NodeSources(module_name)
        self._lock = threading.Lock()
        #: Every origin started this step, in execution order (a replay cut short by an exception reports the first).
        self.started: list[OpFinding] = []
        #: The nearest module of a class at or above a module (op_origins.py sets it): a gradient hook's (hook_definer).
        self.enclosing: Callable[[str, str], str | None] | None = None
        #: The only module of a class below a module (op_origins.py sets it): a direct child's node (defined_below).
        self.within: Callable[[str, str], str | None] | None = None
        #: The watched module strictly below a module that is the module of an id (op_origins.py sets it): which of
        #: several of a class a direct child's node was made by (defined_below's ``owned``).
        self.owned: Callable[[str, int], str | None] | None = None
        #: A watched module's name by its id (op_origins.py sets it): a root's own forward hook, which torch runs
        #: after the watch took the root off its stack (owners.forward_hook_module).
        self.named: Callable[[int], str | None] | None = None
        # What each origin's op left for the report: its tensors (histograms), its user frame (%debug).
        self.witnesses = OpWitnesses()
        #: Set by a replay (replay/untouched.py): called with each tensor an op is about to write, even
        #: by a passive op or after the finding.
        self.before_write: Callable[[torch.Tensor], None] | None = None
        #: The autograd graph task whose ops count as forward ops: set by a
        #: replay that runs a forward inside a gradient hook (-1: none).
        self.forward_task = -1
        #: ``(reference, tensor, line)`` of each non-finite tensor from outside the trace (no op of it made it: a
        #: NaN-coded label) that a forward op read into a non-finite output this step, the first read of each:
        #: the loss code's data (gradient_checks.py), where no local variable names it and no node saved it.
        self.entered_data: list[tuple[TensorRef, torch.Tensor, Any]] = []
        # The non-finite numbers lifted into tensors this step (by the lifted tensor's id, held: a 0-dim tensor), and
        # the memory ops wrote them into (by its address): :meth:`written_into`. Empty on almost every step.
        self._literals: dict[int, tuple[torch.Tensor, OpFinding]] = {}
        self._written: dict[int, OpFinding] = {}
        #: Each lifted number's finding, in order (a replay of recorded ops tells which op lifted it).
        self.literals: list[OpFinding] = []
        #: The live tracer of ops mode (op_origins.make_tracer): the tensors made from a parameter or a model output,
        #: and whether the loop's data region runs (no step open: before the step's first model call), which together
        #: tell an origin the loop built from outside data alone (OpFinding.from_data). None in the replays.
        self.derived: ModelDerived | None = None
        self.data_region: Callable[[], bool] | None = None
        #: The origin of a value made from a non-finite one that the last op read into Python (reached.py).
        self.read_bad: OpFinding | None = None
        #: Each value made of a non-finite one (an integer cast of a NaN, a ``nan_to_num``), by id (reached.py).
        self.made_of: dict[int, weakref.ref[torch.Tensor]] = {}

    def reset(self, origins: bool = True, keep: Sequence[torch.Tensor] = (), ended: bool = False) -> None:
        """Forget the finding and check again; with ``origins``, forget the origins too (a new step); ``ended``: the
        watch is left, no origin stays (a kept one's witness holds the user's frame, and its locals with it).

        ``keep``: tensors whose origins stay, with what the report needs of them. A step opens at its first model
        call, and the batch that call receives was computed before it (``x = (x - mean) / std`` in the loop): its
        origin is claimed only once the call judges its inputs.
        So do the parameters an optimizer's step made non-finite: the deferred check judges it once the next began.
        """
        self.finding = None
        self.producer_tensors = ()
        if origins:
            written = [(address, found) for tensor in keep if tensor.layout is torch.strided
                       and (found := self._written.get(address := tensor.untyped_storage().data_ptr())) is not None]
            stepped = [] if ended else self._origins.stepped()
            kept = [(tensor, self._origins.entry(tensor)) for tensor in [*keep, *stepped]]
            self.started.clear()
            self.read_bad = None
            self.made_of.clear()
            self.entered_data.clear()
            self._literals.clear()
            self._written = dict(written)  # (the batch the call judges was written before the step opened)
            self.literals.clear()
            self._origins.clear()
            self.benign_modules.clear()
            counting, self._origins.counting = self._origins.counting, False  # (no op of ours under the trace)
            for tensor, entry in kept:
                if entry is not None:
                    self._origins.note(tensor, entry)
            self._origins.counting = counting
            # (With the writes' lifts: %debug opens at the line that wrote the number into the batch.)
            self.witnesses.keep_only([entry.finding for _tensor, entry in kept if isinstance(entry, Origin)]
                                     + [found for _address, found in written])

    def note_benign(self, tensors: Sequence[torch.Tensor]) -> None:
        """Take ``tensors`` (a replay's copies of what its code read from outside) as holding deliberate infinities
        the watch already judged benign: a model output masked with -inf, which the live tracer saw made."""
        for tensor in tensors:
            self._origins.note(tensor, BENIGN)

    def origin_of(
        self, tensor: torch.Tensor | None, freed: weakref.ref[torch.Tensor] | None = None
    ) -> OpFinding | Literal["benign"] | None:
        """The op that started ``tensor``'s non-finite values, ``"benign"``, or None (from outside).

        ``freed``: where the tensor is gone by the check (deferred), the weak reference its boundary record holds.
        """
        if tensor is None:
            entry = self._origins.entry_by_ref(freed) if freed is not None else None
        elif (entry := self._origins.entry(tensor)) is None:
            # (A parameter's gradient reshaped from the sum that made it: the same memory; or a parameter rebound
            # to a slice of a vector an op made: vector_to_parameters.)
            entry = self._origins.reshaped_entry(tensor)
            entry = self._origins.holding_entry(tensor) if entry is None else entry
        if isinstance(entry, Origin):
            return entry.finding
        return "benign" if entry is not None else None

    def claim(
        self, tensor: torch.Tensor | None, freed: weakref.ref[torch.Tensor] | None = None
    ) -> OpFinding | Literal["benign"] | None:
        """:meth:`origin_of` a non-finite tensor at a boundary, made the finding when it is an op.

        ``freed``: where the tensor is gone by the check (deferred), the weak reference its boundary record holds.
        The tracer then stops checking until :meth:`reset`, and :attr:`producer_tensors` holds copies of the op's
        output and inputs that are still alive.
        """
        origin = self.origin_of(tensor, freed)
        if isinstance(origin, OpFinding) and self.finding is None:
            with self._lock:
                self.finding = origin
                self.producer_tensors = self.witnesses.copies(origin)
        return origin

    def freed_stats(self, freed: weakref.ref[torch.Tensor]) -> TensorStats | None:
        """The counts (the other numbers unknown) of a boundary tensor the deferred check finds freed (by its record's
        weak reference), where the tracer counts (ops mode, deferred) and an op's origin reached it."""
        return self._origins.stats_by_ref(freed)

    def gradient_recorded(self, grad: torch.Tensor) -> None:
        """The watch's hook recorded ``grad`` (a module output's gradient): its counts are kept where an op's origin
        reached it (ops mode, deferred: Origins.count_boundary), counted with this mode off (not traced as ops)."""
        if self._origins.counting:
            with _disable_current_modes():
                self._origins.count_boundary(grad)

    def _in_module(self) -> bool:
        return self._module_name() is not None

    def claim_earliest(self) -> None:
        """Make the first origin started the finding where no :meth:`claim` made one (a replay whose output no
        origin reached: absorbed by an enclosing call, or a forward that raised before it returned)."""
        if self.finding is None and self.started:
            with self._lock:
                self.finding = self.started[0]
                self.producer_tensors = self.witnesses.copies(self.started[0])

    def claim_origin(self, origin: OpFinding) -> None:
        """Make ``origin`` the finding (a forward replay's that reached the op that raised: reached.py)."""
        with self._lock:
            self.finding = origin
            self.producer_tensors = self.witnesses.copies(origin)

    def claim_first(self, boundary: Sequence[torch.Tensor | None]) -> None:
        """:meth:`claim` the origin of the first non-finite tensor of ``boundary`` that has one.

        A backward replay's boundary is the gradients it returns: a backward formula may make a non-finite value
        that it masks itself (pow's exponent term ``log(0)`` under its ``where``) before the op whose values reach
        them, and the first origin would name the masked one where the other modes name the op that reached them.
        Of several such tensors, the one whose origin was born first: a root replayed for its parameters' gradients
        returns them in the parameters' order, where the backward made another's first (two GeM pools' exponents
        in a ``ParameterList``, the later pool's backward running first), as ops=True names it.
        """
        bad = [tensor for tensor in boundary if tensor is not None and not bool(torch.isfinite(tensor).all())]
        if len(bad) > 1:
            born = {id(finding): index for index, finding in enumerate(self.started)}
            bad.sort(key=lambda tensor: born.get(id(self.origin_of(tensor)), len(born)))
        for tensor in bad:
            self.claim(tensor)
            if self.finding is not None:
                return

    def __enter__(self) -> Self:
        # Tensors may have changed outside the trace without our knowledge.
        self._known.clear()
        self.node_sources.start()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        # What is known is stale once we stop seeing the ops (cleared at __enter__ anyway), and its weak references
        # would stay on the user's parameters as long as they hold the watch: torch.utils.swap_tensors (model.to()
        # under the swap future) refuses a tensor that has one (patches/swaps.py).
        try:
            super().__exit__(*exc)
        finally:
            self._known.clear()
            if self.derived is not None:
                self.derived.clear()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        __tracebackhide__ = True  # (a user's error in an op, a shape mismatch, shows with their frames, not ours)
        kwargs = kwargs or {}
        if _get_mode(_PROXY) is not None:  # make_fx tracing: a read would be a node of its graph, or raise
            return run_op(func, args, kwargs)
        task = torch._C._current_graph_task_id()
        in_backward = task != -1 and task != self.forward_task
        if in_backward and torch.is_grad_enabled() and recomputing():
            # A checkpoint's recompute: forward ops, whose NaN a torch.where may still absorb, as in the forward
            # they repeat (the backward op that reads it is the producer then).
            in_backward = False
        if not isinstance(func, torch._ops.OpOverload):
            return self._opaque(func, args, kwargs, in_backward)
        plan = plan_of(func)
        out = self._checked(func, plan, args, kwargs, in_backward)
        if self.started and not in_backward:
            # (only once an op made a non-finite value this step, and only the forward's: what reached an op, or a
            # read into Python, reached.py; a backward's ops raise no user's error and read nothing of theirs)
            after_op(self, func, args, kwargs, out)
        # (A backward's ops are not followed: derived.py. An output that requires grad is model-derived by that
        # alone: an in-place op on one returns what it wrote.)
        if self.derived is not None and not in_backward and not (isinstance(out, torch.Tensor) and out.requires_grad):
            self.derived.after_op(plan, args, kwargs, out)
        return out

    def _checked(self, func: Any, plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], in_backward: bool) -> Any:
        """Run one op and apply the origin rules to it (the module docstring); its output."""
        __tracebackhide__ = True
        if not in_backward or torch.is_grad_enabled():
            # Forward ops in backward too: a reentrant checkpoint recomputes its forward there, with grad
            # enabled (a backward formula runs without, unless create_graph).
            self.node_sources.note(plan, args, kwargs, func)
        if plan.writes and self.before_write is not None:
            for _, tensor in tensors(plan, args, kwargs, plan.writes):
                self.before_write(tensor)
        if self.finding is not None:
            return run_op(func, args, kwargs)
        parts = self._parts_written(plan, args, kwargs) if plan.writes and self._origins else None
        if plan.literal and (literal := literal_numbers(plan, args)):
            out = run_op(func, args, kwargs)
            self._lifted(op_name(func), out, literal)
            return out
        if self._literals and plan.writes:
            self._literal_writes(plan, args, kwargs)
        if plan.passive and not (plan.fills and odd_scalar(plan, args, kwargs)):
            out = run_op(func, args, kwargs)
            if parts:
                self._keep_parts(parts)
            if self._origins:
                self._carry(plan, args, kwargs, out, func if plan.picks and not in_backward else None)
            return out
        priors = probe_priors(plan, args, kwargs, self._known, self._origins) if plan.writes else {}
        out = run_op(func, args, kwargs)
        if parts:
            self._keep_parts(parts)
        if plan.writes:
            # Autograd bumps the version counter only after the op returns
            # here, so a cached entry for a written tensor still looks current.
            for _, written in tensors(plan, args, kwargs, plan.writes):
                self._known.forget(written)
        if plan.conversion and not narrows(plan, args, kwargs, out):
            if self._origins:  # a widening copy (``.float()``) passes its input's origin on
                self._carry(plan, args, kwargs, out)
            return out
        outputs = list(flatten("output", out))
        if plan.writes and not outputs:
            outputs = list(tensors(plan, args, kwargs, plan.writes))
        bad = self._known.suspects(outputs)
        if bad:
            positions = list_positions(plan, args, kwargs, out) if plan.per_index else {}

            def inputs_of(label: str) -> list[tuple[str, Any]]:
                return list(op_inputs(plan, args, kwargs, positions.get(label)))

            in_place = frozenset(id(t) for _, t in tensors(plan, args, kwargs, plan.writes)) if plan.writes else None
            self._examine(op_name(func), bad, inputs_of, priors, in_backward, in_place)
        return out

    # -- a non-finite number the code wrote into a tensor (``x[3, 2] = float("nan")``) ---------------------------

    def _lifted(self, op: str, out: Any, numbers: list[tuple[str, float]]) -> None:
        """A Python number that is not finite, lifted into a tensor: the op's finding is kept for the tensor it is
        written into (:meth:`written_into`), not started as an origin. Its consumers read it as a value from outside,
        as before (a NaN label the loss reads is still data at the line that read it); only a batch the loop wrote
        it into is named at the writing line. Runs only for such a number, a few times a run at most."""
        if not isinstance(out, torch.Tensor) or self.finding is not None or called_by_us():
            return
        origin = self._start_origin(op, "output", out, frozenset(self._known.kinds(out)), numbers, {}, False, None,
                                    started=False)
        self._literals[id(out)] = (out, origin.finding)
        self.literals.append(origin.finding)

    def _literal_writes(self, plan: Plan, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Note the memory an op writes a lifted number into (``copy_``, ``index_put_``), for :meth:`written_into`."""
        read = [self._literals[id(value)][1] for _, value in tensors(plan, args, kwargs, plan.reads)
                if id(value) in self._literals and self._literals[id(value)][0] is value]
        if read:
            for _, written in tensors(plan, args, kwargs, plan.writes):
                self._written[written.untyped_storage().data_ptr()] = read[-1]

    def written_into(self, tensor: torch.Tensor, take: bool = True) -> OpFinding | None:
        """The lifted number's finding an op wrote into ``tensor``'s memory this step, made the finding; or None.

        For a non-finite batch that no op made (phase data): where the loop wrote a NaN into it, that line is named.
        ``take=False`` (the live tracer of ops mode) leaves the tracer checking: the batch's event may be benign (a
        model that handles NaN-coded missing values), and the loss code may then make the step's real event.
        """
        if not self._written or tensor.layout is not torch.strided or self.finding is not None:
            return None
        found = self._written.get(tensor.untyped_storage().data_ptr())
        if found is not None and take:
            with self._lock:
                self.finding = found
                self.producer_tensors = self.witnesses.copies(found)
        return found

    def _opaque(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], in_backward: bool) -> Any:
        """A higher-order operator (``torch.cond``) is checked as one op.

        The ops inside it run without this mode, so they are not seen.
        """
        out = func(*args, **kwargs)
        if self.finding is None:
            leaves = tree_leaves((args, kwargs))
            inputs = [
                (f"operand[{index}]", value)
                for index, value in enumerate(leaves)
                if isinstance(value, torch.Tensor) or is_number(value)
            ]
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            bad = self._known.suspects(list(flatten("output", outputs)))
            if bad:
                name = f"higher_order.{func.name()}"
                self._examine(name, bad, lambda _label: inputs, {}, in_backward, None)
        return out

    def frame_of(self, finding: OpFinding) -> tuple[FrameType | None, tuple[int, int] | None]:
        """The user's frame that ran a forward origin's op, and its ``(f_lasti, f_lineno)`` then; for ``%debug``."""
        return self.witnesses.frame_of(finding)
