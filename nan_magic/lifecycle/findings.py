"""From a detected non-finite value to a frozen :class:`Report`.

A :class:`Finding` is the engine's working note about one event; it may
still point at live tensors. :func:`build_report` turns it, with the step's
calls and history, into a Report that holds numbers only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from nan_magic.explain.diagnose import diagnose
from nan_magic.hot.checks.optimizer.step_layout import largest_decay
from nan_magic.hot.kept.call_records import Call, TensorRecord
from nan_magic.hot.kept.finding import Finding, record_ref
from nan_magic.hot.kept.step_log import StepLog
from nan_magic.hot.stats import sample_values, tensor_stats
from nan_magic.hot.watched.targets import ModuleInfo
from nan_magic.localize.replay.layer_rows import step_layers, with_op_row
from nan_magic.records import (
    EarlyWarning,
    Phase,
    Report,
    Sample,
    StepSummary,
    TensorRef,
    TensorRole,
    TensorStats,
)

__all__ = ["build_report"]


#: Other layers of the failing step sampled for the histogram selector.
NEARBY_LAYERS = 8


def _nearby_samples(
    log: StepLog, producer: TensorRecord | None, size: int, shown: list[torch.Tensor]
) -> list[Sample]:
    """Samples of the layers that returned just before the producer, while still alive.

    Bounded (``NEARBY_LAYERS`` tensors of ``size`` values) so that a report
    stays small; tensors freed since their call cannot be sampled. A tensor
    is sampled once, under the name of the call that made it: not again where
    it is already ``shown`` among the producer's samples (the producer module's
    output is a child's output too), nor as the output of a parent that
    returned it (``nn.Sequential`` returns its last child's output).
    """
    seen = {_same_values(tensor) for tensor in shown}
    records = [record for call in log.finished() for record in call.outputs if record is not producer]
    if producer is not None and producer.call is not None and producer.call.finished >= 0:
        records = [r for r in records if r.call is not None and r.call.finished <= producer.call.finished]
    kept: list[tuple[TensorRecord, Call, torch.Tensor]] = []
    for record in records:  # in the order the calls returned: a child's output before its parent's
        tensor, call = record.live(), record.call
        if tensor is None or call is None or (values := _same_values(tensor)) in seen:
            continue
        seen.add(values)
        kept.append((record, call, tensor))
    samples = []
    for record, call, tensor in kept[-NEARBY_LAYERS:]:
        # A data call's records are the batch's arguments, any other call's its outputs (step_log.rows).
        role = TensorRole.INPUT if call.phase is Phase.DATA else TensorRole.MODULE_OUTPUT
        samples.append(sample_values(tensor, record_ref(record, role), size, producer=False, module=call.name,
                                     model=call.info.model if call.info is not None else None))
    return samples


def _same_values(tensor: torch.Tensor) -> tuple[object, ...]:
    """What makes two tensors the same values: one memory, one layout (a detached copy of a view is another)."""
    try:
        return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype
    except RuntimeError:  # a sparse or storage-less tensor has no data pointer: the object itself
        return (id(tensor),)


def build_report(
    finding: Finding,
    *,
    step: int,
    log: StepLog,
    history: tuple[StepSummary, ...],
    warnings: tuple[EarlyWarning, ...] = (),
    max_layers: int,
    sample_size: int,
    modules: Iterable[ModuleInfo] = (),
    per_module: bool = True,
    ops: bool = False,
    optimizers: Iterable[torch.optim.Optimizer] = (),
) -> Report:
    """Freeze a finding into a Report (exact stats where tensors are alive); ``ops``: the watch traced every op.

    ``modules``: the watched models' modules, listed in the layer table
    where the step has no row of theirs; ``per_module``: whether the step
    checked every module call (localize/replay/layer_rows.py); ``optimizers``: the watched ones, whose weight
    decay the cause reads (step_layout.largest_decay).
    """
    stats = finding.bad_stats
    if stats is None and finding.bad is not None:
        stats = tensor_stats(finding.bad)
    samples: list[Sample] = []
    input_stats: list[tuple[TensorRef, TensorStats]] = []
    for ref, tensor in finding.inputs:
        input_stats.append((ref, tensor_stats(tensor)))
        samples.append(sample_values(tensor, ref, sample_size))
    input_stats.extend(finding.input_stats)
    if finding.bad is not None:
        samples.append(sample_values(finding.bad, finding.tensor, sample_size))
    # The op's own samples, drawn when it ran, stand for the tensors no longer alive.
    sampled = {sample.tensor for sample in samples}
    samples.extend(sample for sample in finding.samples if sample.tensor not in sampled)
    module_output = None
    shown = [tensor for tensor in (finding.bad, *(tensor for _, tensor in finding.inputs)) if tensor is not None]
    if finding.module_output is not None:
        name, module_stats, module_tensor = finding.module_output
        module_output = (name, module_stats)
        if module_tensor is not None:
            samples.append(sample_values(module_tensor, name, sample_size, module=finding.module or ""))
            shown.append(module_tensor)
    samples.extend(_nearby_samples(log, finding.record, sample_size // 4, shown))
    if finding.record is not None:
        finding.record.status = "benign" if finding.benign else "producer"
    layers, dropped = step_layers(log, modules, max_layers, per_module)
    layers = with_op_row(layers, finding.op, finding.tensor, stats, module_output)
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
        numbers=tuple(finding.numbers),
        layers=layers,
        layers_dropped=dropped,
        samples=tuple(samples),
        history=history,
        warnings=warnings,
        note_facts=tuple(finding.notes),
        absorbed=finding.absorbed,
        autograd_node=finding.autograd_node,
        optimizer=finding.optimizer,
        optimizer_eps=finding.optimizer_eps,
        optimizer_default_eps=finding.optimizer_default_eps,
        optimizer_lr=finding.optimizer_lr,
        optimizer_decay=largest_decay(optimizers),
        ops=ops,
    )
    if report.cause is None:
        report = dataclasses.replace(report, cause=diagnose(report))
    return report


