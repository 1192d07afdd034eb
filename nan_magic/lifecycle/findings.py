"""From a detected non-finite value to a frozen :class:`Report`.

A :class:`Finding` is the engine's working note about one event; it may
still point at live tensors. :func:`build_report` turns it, with the step's
calls and history, into a Report that holds numbers only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import FrameType

import torch

from nan_magic.explain.diagnose import diagnose
from nan_magic.hot.call_records import Call, TensorRecord
from nan_magic.hot.stats import sample_values, tensor_stats
from nan_magic.hot.step_log import StepLog
from nan_magic.localize.origins import OpFinding
from nan_magic.localize.replay import RngState
from nan_magic.records import (
    AbsorbedOp,
    Cause,
    EarlyWarning,
    Phase,
    Report,
    Sample,
    SourcePointer,
    StepSummary,
    TensorRef,
    TensorRole,
    TensorStats,
    sample_label,
)

__all__ = [
    "Finding", "apply_op_finding", "attach_origin", "build_report", "mark_deliberate", "named_inputs", "record_ref",
]


def record_ref(record: TensorRecord, role: TensorRole = TensorRole.MODULE_OUTPUT) -> TensorRef:
    """The reference of a recorded tensor: its own, or ``role`` at its path (a call's output or argument)."""
    path = record.path
    return path if isinstance(path, TensorRef) else TensorRef(role, path=path or "output")


@dataclass
class Finding:
    """One event as the engine first sees it.

    ``bad`` is the non-finite tensor (or None when only its probe is known);
    ``inputs`` the tensors the producer read, by name.
    """

    phase: Phase
    call: Call | None
    tensor: TensorRef
    bad: torch.Tensor | None = None
    record: TensorRecord | None = None
    step: int | None = None
    # RNG state right before the producer module's call (for the scene's replay).
    rng_state: RngState | None = None
    input_stats: list[tuple[TensorRef, TensorStats]] = field(default_factory=list)
    bad_stats: TensorStats | None = None
    inputs: list[tuple[TensorRef, torch.Tensor]] = field(default_factory=list)
    inputs_finite: bool = True
    benign: bool = False
    module: str | None = None
    module_type: str | None = None
    model: str | None = None
    op: str | None = None
    source: SourcePointer | None = None
    cause: Cause | None = None
    notes: list[str] = field(default_factory=list)
    # Where a replay named the op: the module output the check saw, as
    # ``(name, stats, tensor or None)``; ``tensor``/``bad`` are then the op's output.
    module_output: tuple[TensorRef, TensorStats, torch.Tensor | None] | None = None
    # The replay's frame that ran the producing op (replay.py), for %debug, and its
    # ``(f_lasti, f_lineno)`` when the op ran, where the frame ran on after it.
    frame: FrameType | None = None
    frame_position: tuple[int, int] | None = None
    absorbed: AbsorbedOp | None = None
    # Facts the diagnosis reads (see Report): the backward node that ran the op, the optimizer that stepped.
    autograd_node: str | None = None
    optimizer: str | None = None
    optimizer_eps: float | None = None
    optimizer_lr: float | None = None
    # A model output's gradient blamed on the code outside the models without that code's replay
    # confirming it: a model's replay may still find the producer (step_replay.py).
    unconfirmed_outside: bool = False

    def __post_init__(self) -> None:
        if self.call is not None and self.call.info is not None and self.module is None:
            self.module = self.call.info.name
            self.module_type = self.call.info.module_type
            self.model = self.call.info.model


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
    # The tracer keeps the op's output, then its operands by schema name.
    operands = [(TensorRef(TensorRole.OPERAND, label), tensor) for label, tensor in tensors[1:]]
    if op.absorbed is not None:
        inner = op.absorbed
        finding.absorbed = AbsorbedOp(inner.op, inner.module, inner.source, inner.nan, inner.posinf, inner.neginf)
    if op.phase == Phase.BACKWARD and op.backward_code and op.source is not None:
        # A Python backward (a custom Function's) ran the op on its own line: that line is the one to fix.
        finding.source = op.source
        finding.autograd_node = op.autograd_node
        node = f" of {op.autograd_node}" if op.autograd_node else ""
        created = f", whose node was created at {op.forward_source}" if op.forward_source is not None else ""
        finding.notes.append(f"{op.op} ran in a Python backward{node} (a custom autograd.Function's "
                             f"backward, or a gradient hook){created}")
    elif op.phase == Phase.BACKWARD:
        finding.source = op.forward_source or op.source
        finding.autograd_node = op.autograd_node
        node = f" ({op.autograd_node})" if op.autograd_node else ""
        finding.notes.append(f"{op.op} ran in the backward of the forward line{node}")
    else:
        finding.source = op.source
    if op.module is not None and finding.module is None:
        finding.module = op.module
    if op.inner_source is not None and (op.phase != Phase.BACKWARD or op.backward_code):
        # Where inside the library the op ran; for the autograd engine's own backward that is only whatever
        # called backward (torch's, or the optimizer hook a replay ran from), which says nothing.
        finding.notes.append(f"inside {op.inner_source}")
    if finding.bad is None and finding.bad_stats is None:
        # Found by the op tracer itself: the op's own output and inputs.
        finding.inputs_finite = True
        if tensors:
            finding.bad = tensors[0][1]
            finding.inputs.extend(operands)
            # Inputs freed before the boundary where the op's value was claimed: their stats at the op.
            alive = {ref for ref, _tensor in operands}
            finding.input_stats.extend((ref, stats) for ref, stats in op.input_stats if ref not in alive)
        else:
            finding.bad_stats = op.output_stats
            finding.input_stats = list(op.input_stats)
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
            finding.inputs.extend(operands)
        else:
            finding.bad, finding.bad_stats = None, op.output_stats
            finding.input_stats.extend(op.input_stats)


def attach_origin(finding: Finding, origin: OpFinding) -> None:
    """Add the op that started a boundary's non-finite value to its finding.

    The event is the boundary tensor (the loss, a parameter, a gradient):
    the report keeps it and its counts, and the op adds its name, line and
    operands.
    """
    kept = finding.tensor, finding.bad, finding.bad_stats
    apply_op_finding(finding, origin)
    (finding.tensor, finding.bad, finding.bad_stats), finding.module_output = kept, None


def mark_deliberate(finding: Finding, how: str) -> Finding:
    """Make ``finding`` a benign event (PRODUCT.md): ``how`` says what made the deliberate infinity."""
    finding.benign = True
    finding.notes.append(f"a deliberate infinity ({how}): benign while what consumes it stays finite")
    return finding


def named_inputs(call: Call) -> list[tuple[TensorRef, torch.Tensor]]:
    """The inputs of ``call`` still alive, detached, by path: a finding's inputs."""
    named = []
    for path, _record, ref, _version in call.inputs:
        tensor = ref()
        if tensor is not None:
            named.append((TensorRef.argument(path), tensor.detach()))
    return named


#: Other layers of the failing step sampled for the histogram selector.
NEARBY_LAYERS = 8


def _nearby_samples(log: StepLog, producer: TensorRecord | None, size: int) -> list[Sample]:
    """Samples of the layers that returned just before the producer, while still alive.

    Bounded (``NEARBY_LAYERS`` tensors of ``size`` values) so that a report
    stays small; tensors freed since their call cannot be sampled.
    """
    records = [record for call in log.finished() for record in call.outputs if record is not producer]
    if producer is not None and producer.call is not None and producer.call.finished >= 0:
        records = [r for r in records if r.call is not None and r.call.finished <= producer.call.finished]
    samples = []
    for record in reversed(records):
        tensor = record.live()
        if tensor is None or record.call is None:
            continue
        name = record.call.name if record.call.name is not None else "loss"
        samples.append(sample_values(tensor, sample_label(name, str(record.path)), size, producer=False))
        if len(samples) == NEARBY_LAYERS:
            break
    return samples[::-1]


def build_report(
    finding: Finding,
    *,
    step: int,
    log: StepLog,
    history: tuple[StepSummary, ...],
    warnings: tuple[EarlyWarning, ...] = (),
    max_layers: int,
    sample_size: int,
) -> Report:
    """Freeze a finding into a Report (exact stats where tensors are alive)."""
    stats = finding.bad_stats
    if stats is None and finding.bad is not None:
        stats = tensor_stats(finding.bad)
    samples: list[Sample] = []
    input_stats: list[tuple[TensorRef, TensorStats]] = []
    for ref, tensor in finding.inputs:
        input_stats.append((ref, tensor_stats(tensor)))
        samples.append(sample_values(tensor, str(ref), sample_size, ref=ref))
    input_stats.extend(finding.input_stats)
    if finding.bad is not None:
        samples.append(sample_values(finding.bad, str(finding.tensor), sample_size, ref=finding.tensor))
    module_output = None
    if finding.module_output is not None:
        name, module_stats, module_tensor = finding.module_output
        module_output = (name, module_stats)
        if module_tensor is not None:
            samples.append(sample_values(module_tensor, sample_label(finding.module, str(name)), sample_size, ref=name))
    samples.extend(_nearby_samples(log, finding.record, sample_size // 4))
    if finding.record is not None:
        finding.record.status = "benign" if finding.benign else "producer"
    layers, dropped = log.layer_calls(max_layers)
    report = Report(
        phase=finding.phase,
        module=finding.module,
        module_type=finding.module_type,
        model=finding.model,
        step=step,
        nan=(stats.nan or 0) if stats else 0,
        posinf=(stats.posinf or 0) if stats else 0,
        neginf=(stats.neginf or 0) if stats else 0,
        numel=stats.numel if stats else 0,
        tensor=finding.tensor,
        op=finding.op,
        source=finding.source,
        benign=finding.benign,
        cause=finding.cause,
        inputs_finite=finding.inputs_finite,
        first_bad_index=stats.first_bad_index if stats else None,
        dtype=stats.dtype if stats else None,
        output_stats=stats,
        module_output=module_output,
        input_stats=tuple(input_stats),
        layers=layers,
        layers_dropped=dropped,
        samples=tuple(samples),
        history=history,
        warnings=warnings,
        notes=tuple(finding.notes),
        absorbed=finding.absorbed,
        autograd_node=finding.autograd_node,
        optimizer=finding.optimizer,
        optimizer_eps=finding.optimizer_eps,
        optimizer_lr=finding.optimizer_lr,
    )
    if report.cause is None:
        report = dataclasses.replace(report, cause=diagnose(report))
    return report

