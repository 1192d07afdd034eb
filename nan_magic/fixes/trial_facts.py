"""What a fix trial records: where it was applied, how its replay ran, and what it changed.

The facts of a :class:`~nan_magic.records.FixTrial` (render/fixes.py makes their sentences): whether the replay stepped
the optimizer, where its backward started and where its loss came from (step.py), the remedy's own numbers, and the
largest change of an output against the unremedied replay's. Split from runner.py, which picks and runs the trials.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from nan_magic.fix_records import AFTER_THE_LOSS
from nan_magic.fixes.remedies.correction import CorrectionFix
from nan_magic.fixes.remedies.domain import DomainFix
from nan_magic.fixes.remedies.every_use import EveryUse
from nan_magic.fixes.remedies.mask import MaskFix
from nan_magic.fixes.remedies.precision import Float32
from nan_magic.fixes.remedies.stable import StableFix
from nan_magic.fixes.scale_check import off_scale
from nan_magic.fixes.site import Remedy
from nan_magic.fixes.step import FailingStep, StepOutcome, forward_only, held_gradients
from nan_magic.records import FixTrial, Report

__all__ = ["at_producer", "output_change", "remedy_facts", "step_facts", "verified_first"]


#: How many times the largest other quotient (or 1) a quotient over a clamped denominator must be to outweigh them.
_DOMINATES = 1000.0


def at_producer(kind: str, report: Report, **outcome: Any) -> FixTrial:
    """A trial of ``kind`` applied where ``report``'s producer ran."""
    return FixTrial(kind, report.op, report.module, report.source, **outcome)


def step_facts(step: FailingStep, outcome: StepOutcome, report: Report | None = None, base: StepOutcome | None = None,
               op_sizes: tuple[float, float] | None = None) -> tuple[tuple[str, object], ...]:
    """Whether the optimizer step was replayed, where the backward started, where the loss came from or why none;
    given the ``report`` (and the unremedied replay ``base``), what of a finite step is off the healthy scale."""
    facts: tuple[tuple[str, object], ...] = (("stepped", outcome.stepped),
                                             ("backward_from", _backward_from(step, outcome)))
    if report is not None and (off := off_scale(outcome, base, op_sizes)):
        facts += (("off_scale", off),)
    if outcome.loss_from is not None:
        facts += (("loss_from", outcome.loss_from),)
        if outcome.stand_in is not None and outcome.failed in AFTER_THE_LOSS:
            facts += (("loss_code_not_run", outcome.stand_in.pair),)
    elif outcome.no_loss is not None and outcome.failed != "forward":
        facts += (("loss_not_computed", outcome.no_loss.pair),)
        if step.before_loss_code:
            facts += (("before_loss_code", True),)
    return facts


def remedy_facts(kind: str, remedy: Remedy, report: Report, step: FailingStep, outcome: StepOutcome,
                 base: StepOutcome | None = None) -> tuple[tuple[str, object], ...]:
    """:func:`step_facts`, and the remedy's own: the dtype it upcast, the function and eps it changed, its form."""
    sizes = remedy.op_sizes if isinstance(remedy, DomainFix) else None
    facts: list[tuple[str, object]] = list(step_facts(step, outcome, report, base, sizes))
    if kind == "float32":
        facts += [("dtype", report.dtype), ("autocast", tuple(device for device, _ in step.root.autocast or ()))]
        if isinstance(remedy, Float32) and remedy.numbers:
            facts += [("numbers", tuple(sorted(remedy.numbers)))]
        if isinstance(remedy, Float32) and remedy.positional:
            facts += [("positional", tuple(sorted(remedy.positional)))]
    if isinstance(remedy, DomainFix):
        facts += [("function", remedy.function), ("eps", remedy.eps), ("dtype", remedy.dtype), ("form", remedy.form)]
        if remedy.exponents:
            facts += [("exponents", tuple(sorted(remedy.exponents)))]
    if isinstance(remedy, EveryUse):  # (its operand clamped at its other uses on the line too)
        facts += [("every_use", remedy.clamped)]
    if isinstance(remedy, DomainFix) and outcome.failed is None and (
            hidden := remedy.hidden_quotients(_DOMINATES)) is not None:
        # x / 0 clamped (a non-zero numerator over eps): finite, by a quotient of x * 8e6 that outweighs the rest.
        facts += [("over_eps", hidden)]
    if isinstance(remedy, DomainFix) and remedy.inside and outcome.failed is None:
        # Values the clamp moved that were in the domain already (below eps, not 0): healthy ones it changes too.
        facts += [("inside", remedy.inside)]
    if isinstance(remedy, (StableFix, CorrectionFix)):
        facts += [("function", remedy.function), ("form", remedy.form)]
    if isinstance(remedy, StableFix) and remedy.at_line is not None:  # (the edit fuses the op the trial did)
        facts += [("fused_at_line", remedy.at_line)]
    if isinstance(remedy, MaskFix) and remedy.weights_off:
        facts += [("weights_off", True)]
    if isinstance(remedy, (DomainFix, MaskFix)) and remedy.total and remedy.moved == remedy.total:
        # Every value was out of the domain (every row masked): the output no longer depends on them.
        facts += [("moved_all", remedy.total)]
    elif outcome.failed is None and outcome.gradients and not any(outcome.gradients):
        # Finite, and no trained parameter got any gradient: nothing trains with it (std(correction=0) of a batch of
        # one: (h - mean) / std is 0 whatever h is). Said beside the verdict, as moved_all is.
        facts += [("no_gradient", True)]
    if outcome.frozen and outcome.failed is None:
        # The step came out finite, but no gradient reaches these trained parameters through the clamp: not a fix.
        facts += [("frozen", outcome.frozen)]
    return tuple(facts)


def _backward_from(step: FailingStep, outcome: StepOutcome) -> str:
    """Where the replayed backward started (step.py): the loss, the held output gradient, or ones; ``no-grad``:
    none ran, the call was made under no_grad and no loss code of its step was kept (its forward alone replayed)."""
    if forward_only(step) or (not step.root.grad_enabled and outcome.loss_from is None):
        return "no-grad"  # (or a loss the call's output does not feed: step.py's _judge)
    if not step.root.grad_enabled:
        return "no-grad-loss"  # judged by its step's loss code, no backward through it (step.py)
    if outcome.loss_from is not None:
        return "loss"
    return "output-gradient" if held_gradients(step.root) else "ones"


def output_change(base: StepOutcome, outcome: StepOutcome) -> float | None:
    """The largest change of an output against the unremedied replay's finite values (None: none compared)."""
    largest: float | None = None
    for path, before in base.outputs.items():
        after = outcome.outputs.get(path)
        if after is None or after.shape != before.shape:
            continue
        finite = torch.isfinite(before)
        if not bool(finite.any()):
            continue
        difference = (after.double() - before.double()).abs()[finite]
        value = float(difference.max()) if difference.numel() else 0.0
        largest = value if largest is None or math.isnan(value) or value > largest else largest
    return largest


def verified_first(trials: Iterable[FixTrial]) -> tuple[FixTrial, ...]:
    """The trials in the order shown: finite ones first, and of those, ones that hid the NaN (moved_all, no gradient,
    a quotient over eps) after the rest, and ones off the healthy scale (scale_check.py) after those; in each, a
    trial whose backward stood in for a loss never computed (finite through the model only) after one whole step."""
    order = {True: 0, False: 1, None: 2}
    return tuple(sorted(trials, key=lambda trial: (order[trial.finite], bool(trial.fact("moved_all") or trial.fact(
        "no_gradient") or trial.fact("over_eps")) + 2 * bool(trial.fact("off_scale")), bool(
        trial.finite and trial.loss is None and trial.fact("backward_from") == "ones"))))
