"""The forward pass: module hooks, the producer rule, replay and op-level glue.

Global module hooks call :meth:`ForwardChecks.on_forward_pre` and
:meth:`ForwardChecks.on_forward` for every module; only watched modules are
recorded. Each floating output gets one probe; the producer rule
(:meth:`ForwardChecks.judge`) runs on the few that are non-finite, at once or
at the deferred check. A forward producer is then replayed alone under the op
tracer to name its op and line (:meth:`ForwardChecks.replay_into`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nan_magic.engine.calls import Call, TensorRecord, version_of
from nan_magic.engine.findings import Finding, apply_op_finding
from nan_magic.engine.ops import OpFinding, OpTracer
from nan_magic.engine.replay import RngState, capture_rng_state, replay_module
from nan_magic.engine.stats import iter_tensors, kinds_of, relevant_kinds, tensor_stats
from nan_magic.engine.targets import ModuleInfo
from nan_magic.records import Phase

if TYPE_CHECKING:  # pragma: no cover
    from nan_magic.engine.watch import Watch

__all__ = ["ForwardChecks"]


class Frame:
    """A watched module call in progress (the module stack)."""

    __slots__ = ("call", "info", "module", "rng_state")

    def __init__(self, module: nn.Module, info: ModuleInfo, call: Call, rng_state: RngState | None) -> None:
        self.module = module
        self.info = info
        self.call = call
        self.rng_state = rng_state



class ForwardChecks:
    """Forward-pass checks of one watch: the module stack and the producer rule."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.stack: list[Frame] = []
        # Modules whose infinities a replay showed to be deliberate (masks).
        self.masks: set[int] = set()
        self.replaying = False
        config = watch.config
        self.can_replay = config.replay and not config.ops and not watch.defer
        self.tracer: OpTracer | None = None

    def make_tracer(self) -> OpTracer:
        """The op tracer of ops mode, naming modules from this stack."""
        self.tracer = OpTracer(
            kinds=self.watch.config.kinds,
            module_name=self.current_module_name,
            on_finding=self.on_op_finding,
            phase_hint=self.phase_hint,
        )
        return self.tracer

    def on_forward_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self.watch.mine():
            return
        info = self.watch.module_info(module)
        if info is None:
            return
        top_level = not self.stack
        if top_level:
            self.watch.begin_step_if_needed()
        parent = self.stack[-1].call if self.stack else None
        call = self.watch.log.new_call(Phase.FORWARD, info, module, parent)
        for path, tensor in iter_tensors(args, "input"):
            self.watch.log.note_input(call, path, tensor)
        # The generators' state before the call, so a replay draws the same
        # dropout mask (about a microsecond; only where a replay can happen).
        rng = capture_rng_state() if self.can_replay else None
        self.stack.append(Frame(module, info, call, rng))
        if top_level or info.is_root:
            self.record_data(info, module, args, "input")

    def on_forward(self, module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        # always_call hooks are called with (module, args, output) when the
        # forward raised, and with (module, args, kwargs, output) otherwise.
        if not self.watch.mine():
            return
        if not self.stack or self.stack[-1].module is not module:
            return
        frame = self.stack.pop()
        if len(rest) != 2:
            return
        kwargs, output = rest
        call = frame.call
        if kwargs:
            # Global pre-hooks never see kwargs, so they are noted on return.
            for path, tensor in iter_tensors(kwargs, "kwargs"):
                self.watch.log.note_input(call, path, tensor)
            if not self.stack or frame.info.is_root:
                self.record_data(frame.info, module, kwargs, "kwargs")
        if frame.info.watched:
            for path, tensor in iter_tensors(output, "output"):
                fresh = self.watch.log.lookup(tensor) is None
                record = self.watch.log.record_output(call, path, tensor)
                if self.watch.config.backward:
                    self.watch.gradients.hook_output(record, tensor, fresh)
        self.watch.log.finish(call)
        if frame.info.watched and not self.watch.defer:
            for record in call.outputs:
                self.judge(call, record, replay=(frame, args, kwargs))
        if not self.stack and not self.watch.optimizer_in_use():
            # Inference (no optimizer seen): a top-level forward is a step.
            self.watch.sync()
            self.watch.forward_passes += 1
            self.watch.end_step()

    def record_data(self, info: ModuleInfo, module: nn.Module, values: Any, prefix: str) -> None:
        """Tensors entering a watched model from outside, as a ``data`` call.

        Judged like any call (immediately, or at the deferred check), first in
        order, so a NaN already in the batch is reported as phase ``data``.
        """
        tensors = list(iter_tensors(values, prefix))
        if not tensors:
            return
        call = self.watch.log.new_call(Phase.DATA, info, module, None)
        for path, tensor in tensors:
            self.watch.log.record_output(call, path, tensor)
        self.watch.log.finish(call)
        if not self.watch.defer:
            for record in call.outputs:
                self.judge(call, record)
            for path, tensor in tensors:
                self.watch.warn(self.watch.early.observe_batch(self.watch.step, path, tensor))

    def judge(
        self,
        call: Call,
        record: TensorRecord,
        detected_at: str | None = None,
        replay: tuple[Frame, tuple[Any, ...], dict[str, Any]] | None = None,
    ) -> None:
        """Producer or propagator? The one rule, for immediate and deferred checks.

        A call produced a non-finite value when its output holds a kind that
        none of its inputs held (before the call) and none of the parameters
        and buffers it read holds; a non-finite parameter is reported as such.
        """
        out_kinds = relevant_kinds(record.kinds, self.watch.config.kinds)
        if not out_kinds:
            return
        tensor = record.live()
        if call.phase == Phase.DATA:
            self.watch.emit(Finding(Phase.DATA, call, record.path, bad=_detached(tensor), record=record,
                               bad_stats=record.stats() if tensor is None else None, inputs_finite=False))
            return
        if tensor is not None:
            out_kinds = relevant_kinds(tensor_stats(tensor).kinds, self.watch.config.kinds)
        input_kinds = self.input_kinds(call)
        produced = out_kinds - input_kinds - call.inner_kinds
        if call.parent is not None:
            call.parent.inner_kinds |= call.inner_kinds | produced
        if not produced:
            record.status = "propagated"
            return
        named_inputs = self._named_inputs(call)
        bad_parameter = self._bad_parameter(call)
        if bad_parameter is None and self.tracer is not None:
            # Ops mode sees every op: had one produced this, it would have been
            # reported at the op. What is left came from an infinite scalar.
            record.status = "benign"
            return
        if bad_parameter is not None:
            name, parameter = bad_parameter
            finding = Finding(Phase.FORWARD, call, f"parameter {name}", bad=parameter.detach(), record=record,
                              inputs=named_inputs)
            finding.notes.append(f"{name} was already non-finite when {call.name or 'the root module'} read it")
        else:
            finding = Finding(
                Phase.FORWARD,
                call,
                record.path or "output",
                bad=_detached(tensor),
                record=record,
                bad_stats=None if tensor is not None else record.stats(),
                inputs=named_inputs,
                inputs_finite=not input_kinds,
            )
            if replay is not None:
                finding.rng_state = replay[0].rng_state
                if self.replay_into(finding, produced, *replay):
                    return
        if detected_at:
            finding.notes.append(detected_at)
        self.watch.emit(finding)

    def replay_into(
        self, finding: Finding, produced: frozenset[str], frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bool:
        """Replay the producer module under the op tracer to name its op and line.

        Returns True when the replay shows a deliberate infinity instead (an
        op given an infinite scalar, e.g. ``masked_fill(mask, -inf)``): that
        is recorded as benign and not raised; a consumer that turns it into a
        NaN is the producer then.
        """
        if not self.can_replay or frame.rng_state is None:
            return False
        if id(frame.module) in self.masks:
            finding.record.status = "benign"  # type: ignore[union-attr]
            return True
        if any(_mutated(ref(), version) for _path, _record, ref, version in frame.call.inputs):
            finding.notes.append(
                f"{frame.info.name or 'the root module'} changed its input in place, so a replay cannot start "
                "from the values it received; watch with ops=True (%%nantrace --ops) for the op and line"
            )
            return False
        self.replaying = True
        try:
            result = replay_module(
                frame.module, args, kwargs, rng_state=frame.rng_state, kinds=self.watch.config.kinds,
                module_name=frame.info.name,
            )
        finally:
            self.replaying = False
        if result.finding is not None:
            op = result.finding
            apply_op_finding(finding, op)
            finding.notes.append(
                f"replay of {frame.info.name or 'the root module'} on its inputs found the op: replay reproduced "
                f"{op.nan} nan, {op.posinf} +inf, {op.neginf} -inf in {op.op}"
            )
            return False
        if result.held_by_inputs and produced <= {"+inf", "-inf"}:
            self.masks.add(id(frame.module))
            finding.benign = True
            finding.notes.append(
                "a deliberate infinity: an op inside was given an infinite scalar (e.g. masked_fill(mask, -inf)); "
                "benign while its consumers stay finite"
            )
            self.watch.emit(finding)
            return True
        if result.note:
            finding.notes.append(result.note)
        return False

    def input_kinds(self, call: Call) -> frozenset[str]:
        """Kinds the call's inputs held *before* the call (in-place aware)."""
        kinds: set[str] = set()
        for _path, record, ref, version in call.inputs:
            tensor = ref()
            if tensor is not None and version_of(tensor) == version:
                kinds |= kinds_of(tensor)
            elif record is not None and not record.pending:
                # Mutated in place by this module: its value before the call is
                # what the producer rule compares against, and the probe of the
                # call that made it still knows it.
                kinds |= record.kinds
        return relevant_kinds(frozenset(kinds), self.watch.config.kinds)

    def _named_inputs(self, call: Call) -> list[tuple[str, torch.Tensor]]:
        named = []
        for path, _record, ref, _version in call.inputs:
            tensor = ref()
            if tensor is not None:
                named.append((path, tensor.detach()))
        return named

    def _bad_parameter(self, call: Call) -> tuple[str, torch.Tensor] | None:
        """A non-finite parameter or buffer of the called module (recursively)."""
        prefix = f"{call.name}." if call.name else ""
        module = call.module
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.is_floating_point() and relevant_kinds(kinds_of(tensor), self.watch.config.kinds):
                return prefix + name, tensor
        return None


    # -- op-level tracing (ops=True) --------------------------------------------------

    def current_module_name(self) -> str | None:
        return self.stack[-1].info.name if self.stack else None

    def phase_hint(self) -> Phase | None:
        return Phase.OPTIMIZER if self.watch.optimizers.in_step else None

    def on_op_finding(self, op_finding: OpFinding) -> None:
        """The op tracer found the producer op: report it at the op, where it ran."""
        if not self.watch.mine():
            return
        frame = self.stack[-1] if self.stack and op_finding.phase == Phase.FORWARD else None
        finding = Finding(op_finding.phase, frame.call if frame else None, f"{op_finding.tensor} of {op_finding.op}")
        apply_op_finding(finding, op_finding, self.tracer.producer_tensors if self.tracer else ())
        if finding.module is not None:
            info = self.watch.targets.info_by_name(finding.module)
            if info is not None:
                finding.module_type, finding.model = info.module_type, info.model
        if finding.phase == Phase.BACKWARD:
            self.watch.on_gradient_event(finding)
        else:
            self.watch.emit(finding)


def _mutated(tensor: torch.Tensor | None, version: int) -> bool:
    """Whether a still-alive tensor was written in place since ``version``."""
    return tensor is not None and version_of(tensor) != version


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.detach() if tensor is not None else None
