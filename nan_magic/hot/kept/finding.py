"""A finding: the engine's working note about one event, from its detection to its report.

A :class:`Finding` may still point at live tensors (the non-finite one, the
producer's inputs); the checkers make one, the localizer adds the op and line
(localize/ops/origins.py), and lifecycle/findings.py turns it into a frozen Report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch

from nan_magic.hot.kept.call_records import Call, TensorRecord, calling_model
from nan_magic.hot.kept.rng import RngState
from nan_magic.records import AbsorbedOp, Cause, Note, Phase, Sample, SourcePointer, TensorRef, TensorRole, TensorStats

__all__ = ["Finding", "mark_deliberate", "named_inputs", "record_ref"]


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
    # Samples drawn when the producing op ran (its output and operands), where the tensors are gone now.
    samples: list[Sample] = field(default_factory=list)
    inputs_finite: bool = True
    # The producing op's Python-number arguments, ``(operand, value)`` (Report.numbers).
    numbers: list[tuple[str, float]] = field(default_factory=list)
    benign: bool = False
    module: str | None = None
    module_type: str | None = None
    model: str | None = None
    op: str | None = None
    source: SourcePointer | None = None
    cause: Cause | None = None
    notes: list[Note] = field(default_factory=list)
    # Where a replay named the op: the module output the check saw, as
    # ``(name, stats, tensor or None)``; ``tensor``/``bad`` are then the op's output.
    module_output: tuple[TensorRef, TensorStats, torch.Tensor | None] | None = None
    # The replay's frame that ran the producing op (localize/replay/module_run.py), for %debug, and its
    # ``(f_lasti, f_lineno)`` when the op ran, where the frame ran on after it.
    frame: FrameType | None = None
    frame_position: tuple[int, int] | None = None
    # The calls that led to that frame where it had returned (a loss helper's): each the calling frame, its
    # ``(f_lasti, f_lineno)`` at the call, outermost first; the traceback then reads in call order (errors/frames.py).
    frame_calls: tuple[tuple[FrameType, int, int], ...] = ()
    # A gradient judged at the deferred check: where the loop called its backward, ``(code, f_lasti, f_lineno)``
    # (GradientChecks.backward_caller); %debug opens there where no replay names a frame (lifecycle/events.py).
    backward_caller: tuple[CodeType, int, int] | None = None
    # ... and the id of the loss that backward started from: the fix trials replay that loss's code, not the step's
    # last backward's (``l1.backward(retain_graph=True); l2.backward()``, the NaN in l1's, judged after l2's).
    loss_key: int | None = None
    # A forward or data event found at the deferred check: where the loop called the model whose replay named it,
    # ``(code, id(frame), f_lasti, f_lineno)`` (RootCall.caller); %debug opens there where that frame still runs and
    # no replay names a frame, as where the call's output is judged as it returns, not at ``opt.step()``.
    model_caller: tuple[CodeType, int, int, int] | None = None
    absorbed: AbsorbedOp | None = None
    # Facts the diagnosis reads (see Report): the backward node that ran the op, the optimizer that stepped.
    autograd_node: str | None = None
    optimizer: str | None = None
    optimizer_eps: float | None = None
    optimizer_default_eps: float | None = None
    optimizer_lr: float | None = None
    # A model output's gradient blamed on the code outside the models without that code's replay
    # confirming it: a model's replay may still find the producer (localize/replay/tiered/step.py).
    unconfirmed_outside: bool = False
    # Its op ran in the backward of the loop's own autograd.grad(create_graph=True) (MAML's inner step), recorded
    # as the loop's code: a model call's gradient formula, which the step replay's backward may name.
    in_graph_grad: bool = False

    def __post_init__(self) -> None:
        if self.call is not None and self.call.info is not None and self.module is None:
            self.module = self.call.info.name
            self.module_type = self.call.info.module_type
            self.model = calling_model(self.call)


def mark_deliberate(finding: Finding, how: str, **facts: Any) -> Finding:
    """Make ``finding`` a benign event (PRODUCT.md): ``how`` says what made the deliberate infinity, ``facts`` where."""
    finding.benign = True
    finding.notes.append(Note.of("deliberate", how=how, **facts))
    return finding


def named_inputs(call: Call) -> list[tuple[TensorRef, torch.Tensor]]:
    """The inputs of ``call`` still alive, detached, by path: a finding's inputs."""
    named = []
    for path, _argument, _record, ref, _version in call.inputs:
        tensor = ref()
        if tensor is not None:
            named.append((TensorRef.argument(path), tensor.detach()))
    return named
