"""How an op's non-finite output starts, inherits or carries an origin (the rules in tracer.py's docstring).

:class:`OriginRules` holds the tracer's judgement of one examined op: a non-finite output with finite or benign
inputs starts an origin, one with an origin-carrying input inherits it, a passive op carries its inputs' first-born
origin on. It is apart from :mod:`~nan_magic.localize.ops.tracer` so that the dispatch mode (which ops are looked
at, and how cheaply) reads in one sitting; :class:`~nan_magic.localize.ops.tracer.OpTracer` mixes it in.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nan_magic.hot.reads import is_checkable_op_value, relevant_kinds
from nan_magic.hot.stats import tensor_stats
from nan_magic.localize.ops.called import own_number_of
from nan_magic.localize.ops.derived import ModelDerived
from nan_magic.localize.ops.divisor import spread_divisor
from nan_magic.localize.ops.kinds import KnownKinds, Prior, scalar_kinds
from nan_magic.localize.ops.log_edge import log_edge_infinities
from nan_magic.localize.ops.masks import is_additive_mask, reduces_a_mask, selects_whole_rows
from nan_magic.localize.ops.origins import BENIGN, Benign, OpFinding, Origin, Origins, Picked, op_samples
from nan_magic.localize.ops.owners import backward_hook_module, hook_owner
from nan_magic.localize.ops.plans import (
    Plan,
    flatten,
    op_inputs,
    op_name,
    tensors,
)
from nan_magic.localize.ops.sources import (
    NodeSources,
    called_by_the_engine,
    called_by_us,
    defined_below,
    hook_definer,
    sources_of_op,
)
from nan_magic.localize.ops.witnesses import OpWitnesses
from nan_magic.records import KINDS, Phase, TensorRef, TensorRole

__all__ = ["OriginRules"]

#: Consumers of a mask that are the producer of what they make of it (a softmax over a fully masked row: masks.py),
#: even where an index picked the row or a max reduced it.
_MASK_CONSUMERS = ("aten._softmax.", "aten._log_softmax.", "aten._safe_softmax.", "aten.logsumexp.")


def _consumes_whole_rows(op: str, picked: Picked, output: torch.Tensor) -> bool:
    """Whether a mask consumer (a softmax, a logsumexp) reads the rows a pick selected whole, each as a row: over the
    last dimension the selection left whole, as it would on the mask itself (``logits[live].logsumexp(-1)``), not
    across the selected rows (``steps.index_select(0, t).logsumexp(0)``: the selection is named). Told by shapes: a
    softmax keeps its input's, a logsumexp over the last dimension drops or keeps (1) only that one."""
    if not picked.whole_rows or not op.startswith(_MASK_CONSUMERS):
        return False
    rows = picked.output.shape
    return not op.startswith("aten.logsumexp.") or output.shape in (rows[:-1], (*rows[:-1], 1))


def _zeroes_out(op: str, inputs: list[tuple[str, Any]]) -> bool:
    """Whether ``op`` multiplies by a zero: a product meant to drop a value (a DQN's ``(1 - done) * next_max``),
    where 0 * -inf is NaN, is the fault (``torch.where`` drops it), not the max that made the -inf."""
    if not op.startswith("aten.mul"):
        return False
    with torch.no_grad():
        return any(value == 0 if isinstance(value, (int, float)) else
                   isinstance(value, torch.Tensor) and bool((value == 0).any()) for _name, value in inputs)


class OriginRules:
    """The origin rules of :class:`~nan_magic.localize.ops.tracer.OpTracer`: what an examined op starts or carries."""

    # Set by the class that mixes this in.
    _known: KnownKinds
    _lock: threading.Lock
    _module_name: Callable[[], str | None]
    _on_finding: Callable[[OpFinding], None] | None
    _origins: Origins
    _phase_hint: Callable[[], Phase | None] | None
    at_boundary: bool
    data_region: Callable[[], bool] | None
    derived: ModelDerived | None
    benign_modules: set[str | None]
    enclosing: Callable[[str, str], str | None] | None
    within: Callable[[str, str], str | None] | None
    owned: Callable[[str, int], str | None] | None
    named: Callable[[int], str | None] | None
    entered_data: list[tuple[TensorRef, torch.Tensor, Any]]
    finding: OpFinding | None
    kinds: frozenset[str]
    node_sources: NodeSources
    outside_benign: bool
    producer_tensors: tuple[tuple[str, torch.Tensor], ...]
    started: list[OpFinding]
    witnesses: OpWitnesses

    # -- a non-finite output ---------------------------------------------------

    def _examine(
        self,
        op: str,
        bad: list[tuple[str, torch.Tensor]],
        inputs_of: Callable[[str], list[tuple[str, Any]]],
        priors: dict[int, Prior],
        in_backward: bool,
        written: frozenset[int] | None,
    ) -> None:
        """Give each non-finite output its origin: inherited, benign, none, or this op.

        ``written``: ids of the tensors the op writes in place, if any.
        """
        for label, tensor in bad:
            out_kinds = relevant_kinds(self._known.kinds(tensor), self.kinds)
            if not out_kinds:
                continue
            inputs = inputs_of(label)
            inherited: Origin | None = None
            absorbed: Origin | None = None
            held: set[str] = set()
            benign: set[str] = set()
            picked: Picked | None = None
            outside = False
            for argument, value in inputs:
                if not isinstance(value, torch.Tensor):
                    kinds = scalar_kinds(value)
                    held |= kinds
                    benign |= kinds - {"nan"}  # a NaN scalar is never a deliberate infinity
                    continue
                prior = priors.get(id(value))
                kinds = relevant_kinds(prior.kinds() if prior is not None else self._known.kinds(value), self.kinds)
                if not kinds:
                    continue
                held |= kinds
                entry = prior.origin if prior is not None else self._origins.entry(value)
                if entry is None and type(value) is torch.Tensor and value.grad_fn is None:
                    # A parameter's gradient, the reshaped alias of the sum that made it, written by the loop
                    # (``p.grad.div_(scale)`` after a static loss scale): it carries that sum's origin on.
                    entry = self._origins.reshaped_entry(value)
                if entry is None and in_backward:
                    # A forward value autograd saved has lost its Python object: found by its memory.
                    entry = self._origins.memory_entry(value)
                if isinstance(entry, Picked) and not in_backward:
                    picked = picked or entry
                if isinstance(entry, Origin):
                    if in_backward and entry.finding.phase != Phase.BACKWARD:
                        # A forward value read by a gradient formula, which reached no
                        # forward boundary (it would have been reported there).
                        absorbed = absorbed or entry
                    elif inherited is None or self._started_before(entry, inherited):
                        inherited = entry  # the output carries the first-born origin of its inputs'

                elif entry is not None or (self.outside_benign and not in_backward):  # (a replay's received value;
                    benign |= kinds  # in backward, one with no entry came from code unseen: a Function's numpy)
                elif "nan" not in kinds and is_additive_mask(value):
                    benign |= kinds
                    self._origins.note(value, BENIGN)  # looked at once per step, not at every consumer
                else:
                    outside = True
                    if not in_backward:
                        self._note_entered(op, argument, value)
            in_place = written is not None and id(tensor) in written
            if inherited is not None:
                self._origins.note(tensor, inherited, in_place)
            elif outside:
                continue  # a propagator of a value from outside the trace: the watch's own rules
            elif out_kinds <= benign and not reduces_a_mask(op, out_kinds, tensor):
                self._origins.note(tensor, picked or BENIGN, in_place)
                if not in_backward:
                    self.benign_modules.add(self._module_name())
            elif (picked is not None and out_kinds <= benign and not called_by_us()
                  and not _consumes_whole_rows(op, picked, tensor)):
                origin = self._pick_origin(picked)  # (a sum of what an index picked of a mask: the pick's)
                self._origins.note(tensor, origin, in_place)
                self._report(origin)
            elif (picked is not None and not op.startswith(_MASK_CONSUMERS) and not _zeroes_out(op, inputs)
                  and not called_by_us()):
                # A new kind made of what an index picked or a max reduced of a mask (its fully masked row's -inf,
                # squared or multiplied by a weight): the pick or the max is named (origins.Picked).
                origin = self._pick_origin(picked)
                self._origins.note(tensor, origin, in_place)
                self._report(origin)
            elif not called_by_us():
                new = frozenset(out_kinds - held) or out_kinds
                origin = self._start_origin(op, label, tensor, new, inputs, priors, in_backward, absorbed, in_place)
                self._origins.note(tensor, origin, in_place)
                self._report(origin)
            if self.finding is not None:
                return

    def _note_entered(self, op: str, argument: str, value: torch.Tensor) -> None:
        """Keep a non-finite tensor from outside the trace that ``op`` read, with its line (only the first read)."""
        if (
            value.grad_fn is None
            and not value.requires_grad
            and not called_by_us()
            and (self._phase_hint is None or self._phase_hint() is None)  # (not the optimizer's, nor data code's)
            and all(t is not value for _, t, _ in self.entered_data)
        ):
            self.entered_data.append(
                (TensorRef(TensorRole.INPUT, op, argument), value, sources_of_op(sys._getframe(1))[0])
            )

    def _started_before(self, entry: Origin, other: Origin) -> bool:
        """Whether ``entry``'s op ran first (``-x / scale**2 - log(scale)``: the log's, at scale 0, did)."""
        order = {id(finding): index for index, finding in enumerate(self.started)}  # (kept from a step before: -1)
        return order.get(id(entry.finding), -1) < order.get(id(other.finding), -1)

    def _start_origin(
        self,
        op: str,
        label: str,
        tensor: torch.Tensor,
        new: frozenset[str],
        inputs: list[tuple[str, Any]],
        priors: dict[int, Prior],
        in_backward: bool,
        absorbed: Origin | None,
        in_place: bool = False,
        started: bool = True,
    ) -> Origin:
        """An origin: this op made ``tensor`` non-finite from finite or benign inputs.

        ``started``: noted among the step's origins (a lifted number's finding is kept apart: tracer._lifted)."""
        node = torch._C._current_autograd_node() if in_backward else None
        phase = Phase.BACKWARD if in_backward else None
        if phase is None and self._phase_hint is not None:
            phase = self._phase_hint()
        op_frame = sys._getframe(1)
        source, inner, user_frame = sources_of_op(op_frame)
        # A Python backward (a custom Function's) runs its ops in the user's code: its line is where the op ran.
        backward_code = in_backward and user_frame is not None and called_by_the_engine(op_frame, user_frame)
        output_stats = tensor_stats(tensor)
        input_stats = []
        witnesses = [(label, weakref.ref(tensor))]
        for name, value in inputs:
            if not isinstance(value, torch.Tensor):
                continue
            prior = priors.get(id(value))
            if prior is not None:
                input_stats.append((TensorRef(TensorRole.OPERAND, name, before=True), prior.stats()))
            elif is_checkable_op_value(value):
                input_stats.append((TensorRef(TensorRole.OPERAND, name), tensor_stats(value)))
                witnesses.append((name, weakref.ref(value)))
        forward_source, forward_module = self.node_sources.forward_source(node)
        if node is not None and not backward_code:  # (a child whose forward its parent called directly)
            number = node._sequence_nr()
            owner = self.node_sources.owner_of(number)
            owned = self.owned(forward_module, owner) if (
                self.owned is not None and forward_module is not None and owner is not None) else None
            forward_module = defined_below(forward_module, self.node_sources.code_of(number), self.within, owned)
        if backward_code:
            module = self._hooked(hook_definer(forward_module, user_frame, self.enclosing), user_frame)
        else:
            module = forward_module if in_backward else hook_owner(user_frame, self._module_name(), self.named)
        finding = OpFinding(
            op=op,
            phase=phase or Phase.FORWARD,
            module=module,
            source=source,
            inner_source=inner,
            forward_source=forward_source,
            autograd_node=node.name() if node is not None else None,
            node_number=node._sequence_nr() if node is not None else None,
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
            backward_code=backward_code,
            own_number=own_number_of(user_frame) if not in_backward and inner is None and any(
                not math.isfinite(value) for _name, value in inputs if isinstance(value, (int, float))) else None,
            samples=op_samples(op, label, tensor, [(name, value) for name, value in inputs if id(value) not in priors]),
            from_data=phase is None and module is None and self._from_data(inputs),
            log_edge=log_edge_infinities(op, tensor, inputs) if not in_backward else None,
            spread=spread_divisor(op, inputs) if not in_backward else None,
        )
        # %debug's frame (line_state.py): a forward op's, or a Python backward's.
        frame = user_frame if not in_backward or backward_code else None
        self.witnesses.note(finding, witnesses, frame, in_place)
        origin = Origin(finding)
        if not started:
            return origin
        self.started.append(finding)
        if not in_backward:
            self._origins.note_memory(tensor, origin)
        return origin

    def _from_data(self, inputs: list[tuple[str, Any]]) -> bool:
        """Whether the loop's data region ran the op on tensors no parameter nor model output went into (ops mode's
        live tracer only: derived.py); the origin's phase is data then."""
        derived, region = self.derived, self.data_region
        return derived is not None and region is not None and region() and not derived.any_of(
            value for _name, value in inputs)

    def _hooked(self, module: str | None, user_frame: Any) -> str | None:
        """A Python backward's module: the hooked module where ``user_frame`` is a module's full backward (pre-)hook
        (owners.backward_hook_module; named below ``module``, its node's), else ``module``."""
        owned = self.owned
        if module is None or owned is None:
            return module
        hooked = backward_hook_module(user_frame)
        return (owned(module, id(hooked)) or module) if hooked is not None else module

    def _report(self, origin: Origin) -> None:
        """Without ``at_boundary``, the first origin is the finding, reported inside its op."""
        if self.at_boundary:
            return
        with self._lock:
            if self.finding is not None:
                return
            self.finding = origin.finding
            self.producer_tensors = self.witnesses.copies(origin.finding)
        if self._on_finding is not None:
            self._on_finding(origin.finding)

    # -- carrying origins on ---------------------------------------------------

    def _picked(self, op: str, plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor,
                whole_rows: bool) -> Picked:
        """What a pick of a mask's infinities is noted as: its line and module now, its numbers if a sum claims it."""
        source, inner, user_frame = sources_of_op(sys._getframe(1))
        phase = self._phase_hint() if self._phase_hint is not None else None
        inputs = list(op_inputs(plan, args, kwargs, None))
        where = (id(user_frame), user_frame.f_code, user_frame.f_lasti, user_frame.f_lineno) if user_frame else None
        return Picked(op, out, inputs, source, inner, hook_owner(user_frame, self._module_name(), self.named),
                      phase or Phase.FORWARD, where, whole_rows)

    def _pick_origin(self, picked: Picked) -> Origin:
        """The origin a pick starts once a sum adds up what it picked (origins.Picked): the op's finding."""
        tensor, inputs = picked.output, picked.alive_inputs()
        output_stats = tensor_stats(tensor)
        label = "output"
        finding = OpFinding(
            op=picked.op, phase=picked.phase, module=picked.module, source=picked.source,
            inner_source=picked.inner_source, forward_source=None, autograd_node=None, tensor=label,
            new_kinds=tuple(kind for kind, count in zip(KINDS, (output_stats.nan, output_stats.posinf,
                                                                output_stats.neginf)) if count),
            nan=output_stats.nan or 0, posinf=output_stats.posinf or 0, neginf=output_stats.neginf or 0,
            numel=output_stats.numel, output_stats=output_stats,
            input_stats=tuple((TensorRef(TensorRole.OPERAND, name), tensor_stats(value)) for name, value in inputs
                              if isinstance(value, torch.Tensor) and is_checkable_op_value(value)),
            scalars=tuple((name, value) for name, value in inputs if isinstance(value, (int, float))),
            samples=op_samples(picked.op, label, tensor, inputs),
        )
        witnesses = [(label, weakref.ref(tensor)), *((name, weakref.ref(value)) for name, value in inputs
                                                       if isinstance(value, torch.Tensor))]
        # %debug: the pick's frame where the op naming it runs in it still (its line has ended: the locals are the
        # ones the current line leaves); else none (a pooling child's frame has returned).
        _source, _inner, frame = sources_of_op(sys._getframe(1))
        same = frame is not None and picked.frame is not None and picked.frame[:2] == (id(frame), frame.f_code)
        self.witnesses.note(finding, witnesses, frame if same else None,
                            at=picked.frame[2:] if same and picked.frame is not None else None)
        self.started.append(finding)
        origin = Origin(finding)
        self._origins.note(tensor, origin)
        self._origins.note_memory(tensor, origin)
        return origin

    def _parts_written(self, plan: Plan, args: Sequence[Any], kwargs: dict[str, Any]
                       ) -> list[tuple[torch.Tensor, Origin | Benign]]:
        """The bases an in-place op is about to write part of through a view, with their origins: noted again once
        it wrote (:meth:`_keep_parts`). A write of finite values into part of a non-finite tensor (``pad_sequence``'s
        copies into its ``full(nan)``, ``mask[..., :k] = 0``) leaves the other elements as they were, and the base's
        version, which the write moves, must not lose their origin (a boundary's claim would find none: "from
        outside")."""
        held = []
        for _, tensor in tensors(plan, args, kwargs, plan.writes):
            base = tensor._base
            if base is not None and tensor.numel() < base.numel():
                entry = self._origins.entry(base)
                if entry is not None:
                    held.append((base, entry))
        return held

    def _keep_parts(self, held: list[tuple[torch.Tensor, Origin | Benign]]) -> None:
        """Note again the origins :meth:`_parts_written` found (before the op's own rules note theirs, which win)."""
        for base, entry in held:
            self._origins.note(base, entry, written=True)

    def _carry(self, plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], out: Any, picks: Any = None) -> None:
        """A passive op passes its inputs' first-born origin on to its outputs (a view, ``cat``, ``where``).

        It counts only where the output is non-finite (looked up only for such a tensor). Of several origins the
        first born, as for an op (logdet's ``where(sign == -1, nan, logabsdet)``: its -inf is slogdet's), and an
        op's origin over a deliberate infinity read before it (``cat([masked, 0 / 0])``: the NaN is the division's).
        ``picks``: a forward op that picks by index (``gather``); what it picks of a mask is noted as picked."""
        entry = None
        for _, tensor in tensors(plan, args, kwargs, plan.reads):
            found = self._origins.entry(tensor)
            if found is not None and not relevant_kinds(self._known.kinds(tensor), self.kinds):
                # A finite input whose op carried an origin on (``tanh`` of an overflowed ``exp``, an ``isnan`` mask):
                # none of the output's non-finite values is its; ``cat([tanh(exp(h)), log(0)])``'s is the log's.
                continue
            wins = isinstance(found, Origin) and (not isinstance(entry, Origin) or self._started_before(found, entry))
            if entry is None or wins:
                entry = found
        if entry is None:
            return
        values = out[0] if isinstance(out, tuple) and out else out  # (max.dim: values, indices)
        if picks is not None and isinstance(values, torch.Tensor) and (
                type(entry) is Benign or (isinstance(entry, Picked) and entry.whole_rows)):
            # (a pick out of rows an index selected whole is this pick: ``logits[live].gather(1, a)``)
            entry = self._picked(op_name(picks), plan, args, kwargs, values, selects_whole_rows(picks, args, kwargs))
        note = self._origins.note_view if plan.view else self._origins.note
        for _, output in flatten("output", out):
            note(output, entry)
        for _, written in tensors(plan, args, kwargs, plan.writes):
            self._origins.note(written, entry, written=True)
