"""At a real event: pick the remedies that fit its cause, try each on a replay of the failing step.

Which remedy fits (issue 28's table): ``float32`` where the producer ran in
half or bfloat16 or under autocast; ``eps`` where its function has a domain
(log, sqrt, rsqrt, pow, a division, acos, asin, atanh, logit); ``stable`` for an exp, or a
log that may be of a softmax, and ``correction=0`` for a std or variance of
one element (remedies/correction.py); ``mask`` for a softmax over a fully masked
row; ``skip-batch`` for a batch that entered holding non-finite values;
``scale`` for a collapsing GradScaler (remedies/scale.py); ``lr`` for a run that
diverged before a forward or backward event (remedies/diverged.py), or at an
optimizer event (remedies/optimizer_step.py). Each is tried alone (step.py) and judged
against one unremedied replay: the step must come out finite end to end to
count as verified, and ``output_change`` shows what else it changed.

The trials run only at an event (a healthy step pays nothing), within a
budget of :data:`STEP_TIMES` times the unremedied replay's time (at least
:data:`MIN_BUDGET` seconds); a remedy left over says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from nan_magic.distributed.ranks import is_sharded, process_group
from nan_magic.explain.evidence import HALF as HALF_NAMES
from nan_magic.explain.evidence import node_function
from nan_magic.fix_records import FUNCTIONS
from nan_magic.fixes.kept import KeptStep
from nan_magic.fixes.loss import LossCode, LossSource, loss_code, unjudged, with_code_before
from nan_magic.fixes.no_remedy import in_update_code, none_fit, update_code_note
from nan_magic.fixes.remedies import batch as batches
from nan_magic.fixes.remedies.correction import CORRECTED, CorrectionFix
from nan_magic.fixes.remedies.data_code import remedied_batch
from nan_magic.fixes.remedies.diverged import lr_trial
from nan_magic.fixes.remedies.domain import DomainFix
from nan_magic.fixes.remedies.every_use import at_every_use
from nan_magic.fixes.remedies.mask import MASKED, MaskFix
from nan_magic.fixes.remedies.optimizer_step import redo_step
from nan_magic.fixes.remedies.precision import Float32, refused_upcast
from nan_magic.fixes.remedies.scale import collapsed_scale, scaled, try_scales
from nan_magic.fixes.remedies.stable import StableFix, changes_value, declined, stable_replay
from nan_magic.fixes.site import InRecordedCode, Remedy, Site
from nan_magic.fixes.step import FailingStep, StepOutcome, replay_step
from nan_magic.fixes.trial_facts import at_producer, output_change, remedy_facts, step_facts, verified_first
from nan_magic.localize.outside.region_records import RegionRecords
from nan_magic.localize.replay.tiered.root_calls import RootCall, replay_target
from nan_magic.localize.replay.tiered.step import StepReplays
from nan_magic.patches.scaler import scaler_source
from nan_magic.records import FixTrial, Note, Phase, Report, TensorRole
from nan_magic.scene.last_good import LastGood
from nan_magic.tensor_refs import op_function

__all__ = ["MIN_BUDGET", "STEP_TIMES", "KeptStep", "LossSource", "batch_call", "fixes_for", "kept_fixes", "try_fixes",
           "try_optimizer_fixes", "untried", "with_fixes"]

#: The optimizer-step remedy each cause of an optimizer event takes (remedies/optimizer_step.py).
_STEP_REMEDIES = {"learning-rate-too-high": "lr", "optimizer-eps-underflow": "eps"}

#: The trials' budget, in replays of the failing step (each trial is about one).
STEP_TIMES = 8
#: ... and at least this many seconds (a step of a tiny model takes a millisecond).
MIN_BUDGET = 2.0


def producer_site(report: Report) -> Site:
    """Where the producer ran, and the torch function behind its op (a backward op: its node's forward; an op in a
    Python backward, a custom autograd.Function's ``RecipBackward``: the op's own, at its line in that backward)."""
    node = report.autograd_node
    python_backward = node is not None and node.endswith("Backward")  # (torch's own nodes end ``Backward0``...)
    function = node_function(node) if node and not python_backward else op_function(report.op)
    return Site(report.module, report.source, function, in_backward=node if python_backward else None)


def _candidates(report: Report, site: Site, step: FailingStep) -> list[tuple[str, Remedy]]:
    remedies: list[tuple[str, Remedy]] = []
    half = report.dtype in HALF_NAMES
    if half or step.root.autocast:
        remedies.append(("float32", Float32()))
    if site.function in FUNCTIONS:
        spread = report.cause is not None and report.cause.reading == "spread-zero"
        remedies.append(("eps", DomainFix(site.function, added=spread)))
    if site.function in ("exp", "log"):
        remedies.append(("stable", StableFix(site.function)))
    if site.function in CORRECTED and report.cause is not None and report.cause.reading == "corrected-one":
        remedies.append(("stable", CorrectionFix(site.function)))
    if site.function in MASKED and report.cause is not None and report.cause.label == "masked-softmax":
        remedies.append(("mask", MaskFix()))
    return remedies


def with_fixes(report: Report, replays: StepReplays, optimizers: Iterable[torch.optim.Optimizer],
               roots: Iterable[nn.Module], last_good: LastGood,
               standing_aside: Callable[[], contextlib.AbstractContextManager[None]], loss: LossSource,
               stops: bool = False) -> Report:
    """``report`` with its remedies' trials (:func:`fixes_for`); trials that fail leave a note, never a lost report.

    ``stops``: the event stops the run (``on_detect="raise"``), so an interrupt during the trials ends them alone.
    """
    return _trying(report, functools.partial(fixes_for, report, replays, optimizers, roots, last_good, standing_aside,
                                             loss), stops)


def _trying(report: Report, trials: Callable[[], tuple[FixTrial, ...]], stops: bool = False) -> Report:
    """``report`` with ``trials()``; where they cannot run or fail, a note says why instead.

    An interrupt while they run (the trials of a large model take seconds, and the user presses stop) ends only
    the trials where the event stops the run anyway (``stops``): the report, its producer found, is not lost to
    it. Where the run goes on after the event (warn, log), the interrupt goes on too: it stops the run.
    """
    try:
        return dataclasses.replace(report, fixes=trials())
    except KeyboardInterrupt:
        if not stops:
            raise
        return dataclasses.replace(report, note_facts=(*report.note_facts, Note("fixes-interrupted")))
    except _NoTrial as none:
        return dataclasses.replace(report, note_facts=(*report.note_facts, none.note))
    except Exception as error:  # the trials are a sidecar: they never take the report down
        note = Note.of("fixes-failed", error=type(error).__name__, message=str(error))
        return dataclasses.replace(report, note_facts=(*report.note_facts, note))


def untried(seen: Report, replayed: tuple[Report, Any] | None, frame: Any, kept: KeptStep,
            optimizers: Iterable[torch.optim.Optimizer], roots: Iterable[nn.Module], last_good: LastGood,
            stops: bool = False) -> tuple[Report, Any] | None:
    """The first real event of a per-call (``mode="full"``) or traced (``ops=True``) watch, which localized it
    without a step replay: its remedies tried on a replay of the failing step all the same (kept.py).

    ``seen``: the event's report, or ``replayed``'s where a replay (a bad batch's samples) made one; ``frame``: the
    producer's frame, kept with the report made here; ``kept``: the step's top-level calls and what the trials
    need (none with ``replay=False``: nothing is run again). An optimizer step's remedies need no model call (its
    step is redone on copies from the last good state, remedies/optimizer_step.py); with the op tracer standing aside.
    ``stops``: as :func:`with_fixes`'.
    """
    report = seen if replayed is None else replayed[0]
    if report.benign:
        return replayed
    if report.phase == Phase.OPTIMIZER:
        report = _trying(report, functools.partial(_aside, kept.aside, functools.partial(
            _optimizer_fixes, report, list(optimizers), list(roots), last_good)), stops)
    elif kept.replays is None or in_update_code(report):
        note = update_code_note(report) if in_update_code(report) else Note("fixes-traced" if kept.traced
                                                                            else "fixes-per-call")
        report = dataclasses.replace(report, note_facts=(*report.note_facts, note))
    else:
        report = _trying(report, functools.partial(kept_fixes, report, kept, optimizers, roots, last_good), stops)
    return report, ((frame, None) if replayed is None else replayed[1])


def _aside(aside: Callable[[], contextlib.AbstractContextManager[None]], trials: Callable[[], tuple[FixTrial, ...]]
           ) -> tuple[FixTrial, ...]:
    with aside():
        return trials()


def kept_fixes(report: Report, kept: KeptStep, optimizers: Iterable[torch.optim.Optimizer],
               roots: Iterable[nn.Module], last_good: LastGood) -> tuple[FixTrial, ...]:
    """The trials for a real event of a per-call or traced watch, on the top-level call it kept (kept.py).

    Honest as the tiered watch's: the remedies are judged against the unremedied replay of that call, which
    must go non-finite again (else no remedy is tried, and a note says why). A backward event's candidates are
    tried the latest first, as the tiered watch's replay tries them, until one's replay goes non-finite.
    """
    calls = kept.failing_calls(report)
    if isinstance(calls, Note):
        raise _NoTrial(calls)
    for index, root in enumerate(calls):
        try:
            return _kept_trials(report, kept, root, optimizers, list(roots), last_good)
        except _NoTrial as none:
            if not none.note.kind.startswith("fixes-not-reproduced") or index == len(calls) - 1:
                raise  # (a call whose replay stays finite: the next one, a backward event's, may be the one)
    return ()


def _kept_trials(report: Report, kept: KeptStep, root: RootCall, optimizers: Iterable[torch.optim.Optimizer],
                 roots: list[nn.Module], last_good: LastGood) -> tuple[FixTrial, ...]:
    """The trials on a replay of ``root``, a call ``kept``: :func:`try_fixes` on its step."""
    model = kept.replays.model_of(root.module) if kept.replays is not None else None
    if model is None:
        _alone(root.module, None, optimizers, None)  # FSDP (no eager model to replay): the other ranks, say so
        raise _NoTrial(Note("fixes-no-call"))
    target = replay_target(root.module) or model
    calls = kept.replays.calls if kept.replays is not None else ()
    read = _read_by_the_loss(report, kept.loss, root, calls)
    if isinstance(read, Note) or (report.phase == Phase.DATA and read is None and not batches.holds_nonfinite(root)):
        raise _NoTrial(Note.of(_no_code_kind(report), reason=read.pair) if isinstance(read, Note) else (
            batches.outside_note(report, (root,)) or Note("fixes-batch-outside")))  # (as the tiered watch says it)
    before_loss = read is None and (report.phase == Phase.DATA or (report.phase == Phase.FORWARD
                                                                  and not _in_loss_code(report)))
    code = read or loss_code(kept.loss, root, before_loss=before_loss, calls=calls)
    if _in_loss_code(report) and not isinstance(code, LossCode):
        # Its remedies go in the loss code, and without it the replayed step never reaches the producer.
        raise _NoTrial(Note.of("fixes-no-loss-code", reason=code.pair))
    _alone(root.module, target, optimizers, code)
    step = FailingStep(root, model, target, tuple(optimizers), kept.aside, loss_code=code,
                       scalers=tuple(kept.loss.scalers), before_loss_code=before_loss and not kept.loss.judged_at_check)
    return try_fixes(report, step, roots, last_good, data_code=kept.loss.recorder,
                     reproduce="traced" if kept.traced else "per-call", in_loss=read is not None)


def _no_code_kind(report: Report) -> str:
    """A producer in code the trials cannot run again: the data code's (a target it built) or the loss code's."""
    return "fixes-no-data-code" if report.phase == Phase.DATA else "fixes-no-loss-code"


def fixes_for(report: Report, replays: StepReplays, optimizers: Iterable[torch.optim.Optimizer],
              roots: Iterable[nn.Module], last_good: LastGood,
              standing_aside: Callable[[], contextlib.AbstractContextManager[None]],
              loss: LossSource) -> tuple[FixTrial, ...]:
    """The trials for a real event that the watch's step replays localized (lifecycle/watch.py).

    ``loss``: the recorded loss code, which each replayed step runs on its outputs (loss.py).
    """
    if report.phase == Phase.OPTIMIZER:
        return _optimizer_fixes(report, optimizers, roots, last_good)
    if in_update_code(report):  # (the replayed step never runs the code between backward() and the step)
        raise _NoTrial(update_code_note(report))
    # The call whose replay named the producer; for a batch that entered non-finite, the call given it; for a
    # producer in the loss code, the step's last call (the loss code reads its outputs: loss.py checks).
    root = replays.replayed if report.reproduced else None
    loss_read = None
    if report.phase == Phase.DATA:
        root = batch_call(replays.calls)
        if root is None and replays.calls:
            loss_read = _read_by_the_loss(report, loss, replays.calls[-1], replays.calls)
            if isinstance(loss_read, Note):
                raise _NoTrial(Note.of("fixes-no-data-code", reason=loss_read.pair))
            root = replays.calls[-1] if loss_read is not None else None
    elif _in_loss_code(report) and root is None and replays.calls:
        root = replays.calls[-1]
    model = replays.model_of(root.module) if root is not None else None
    if root is None or model is None:
        none = batches.outside_note(report, replays.calls) if report.phase == Phase.DATA else Note("fixes-no-call")
        if none is None:
            return ()
        raise _NoTrial(none)
    target = replay_target(root.module) or model
    # A forward event inside a model stops the step before its loss code; one in the loss code comes after it.
    before_loss = loss_read is None and (report.phase == Phase.DATA or (report.phase == Phase.FORWARD
                                                                  and not _in_loss_code(report)))
    code = loss_read or loss_code(loss, root, before_loss=before_loss, calls=replays.calls)
    _alone(root.module, target, optimizers, code)
    # Where the replay reproduced the event only from the parameters as the call read them (SAM's second forward at
    # ``w + e``, judged at the deferred check after the loop restored ``w``): the trials start from those too.
    read = replays.read_parameters if root is replays.replayed else {}
    parameters = {name: read[id(p)] for name, p in target.named_parameters() if id(p) in read} or None
    replays.read_parameters = {}  # (read once: a warn-mode run held a copy of the parameters to its next event)
    step = FailingStep(root, model, target, tuple(optimizers), standing_aside, parameters=parameters, loss_code=code,
                       scalers=tuple(loss.scalers), before_loss_code=before_loss and not loss.judged_at_check)
    return try_fixes(report, step, list(roots), last_good, data_code=loss.recorder, in_loss=loss_read is not None)


def _read_by_the_loss(report: Report, loss: LossSource, root: RootCall, calls: Iterable[RootCall]
                      ) -> LossCode | Note | None:
    """The loss code run from the loop's code before the model call (loss.py's ``with_code_before``), where a data
    event's producer made there a value only the loss code read (``1 / counts`` of an empty class); why it cannot
    be run so; or None where the event is no such one (a batch given the model non-finite values)."""
    if report.phase != Phase.DATA or report.module is not None or report.op is None or (
            (function := producer_site(report).function) not in FUNCTIONS and function not in CORRECTED) or (
                batches.holds_nonfinite(root)):
        return None
    code = loss_code(loss, root, before_loss=False, calls=calls)
    return with_code_before(code, loss.recorder) if isinstance(code, LossCode) and loss.recorder is not None else code


def _optimizer_fixes(report: Report, optimizers: Iterable[torch.optim.Optimizer], roots: Iterable[nn.Module],
                     last_good: LastGood) -> tuple[FixTrial, ...]:
    """An optimizer event's trials (:func:`try_optimizer_fixes`), where this rank can run them alone."""
    _alone(None, None, optimizers, None)
    return try_optimizer_fixes(report, optimizers, roots, last_good)


class _NoTrial(Exception):
    """No trial runs (``note`` says why)."""

    def __init__(self, note: Note) -> None:
        super().__init__(note.text)
        self.note = note


class _NeedsRanks(_NoTrial):
    """No trial runs: one would need the other ranks of the process group."""


#: The namespaces of the ops that communicate across ranks.
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})


def _alone(module: nn.Module | None, target: nn.Module | None, optimizers: Iterable[torch.optim.Optimizer],
           code: LossCode | Note | None) -> None:
    """Raise :class:`_NeedsRanks` where a trial under a process group of several ranks would run a collective.

    A trial runs on this rank alone, while the others wait at the next agreement point: a collective would wait
    for them, and hang the job. The step replay needs none for a model wrapped by DDP (it runs the wrapped
    module on copies of its parameters, which carry none of DDP's reduction hooks), an optimizer of torch.optim
    and loss code of local ops; FSDP, a SyncBatchNorm that trains, an optimizer of torch.distributed (ZeRO) and
    a collective in the loss code need them.
    """
    group = process_group()
    if group is None or group[1] <= 1:
        return
    why = None
    if module is not None and is_sharded(module):
        why = Note("ranks-sharded")
    elif target is not None and any(isinstance(sub, nn.SyncBatchNorm) and sub.training for sub in target.modules()):
        why = Note("ranks-sync-batchnorm")
    elif shared := next((type(opt).__name__ for opt in optimizers
                         if type(opt).__module__.startswith("torch.distributed")), None):
        why = Note.of("ranks-optimizer", optimizer=shared)
    elif isinstance(code, LossCode) and (op := next((op.func for op in code.ops
                                                     if getattr(op.func, "namespace", "") in _COLLECTIVES), None)):
        why = Note.of("ranks-collective", op=str(op))
    if why is not None:
        raise _NeedsRanks(Note.of("needs-ranks", ranks=group[1], reason=why.pair))


def batch_call(calls: Iterable[RootCall]) -> RootCall | None:
    """The latest model call of the step that was given non-finite data (a ``data`` event's), or None."""
    return next((root for root in reversed(list(calls)) if batches.holds_nonfinite(root)), None)


#: A trial to run: what it returns is the record.
_Try = Callable[[], FixTrial]


def try_fixes(report: Report, step: FailingStep, roots: Iterable[nn.Module] = (),
              last_good: LastGood | None = None, data_code: RegionRecords | None = None,
              reproduce: str | None = None, in_loss: bool = False) -> tuple[FixTrial, ...]:
    """The remedies that fit ``report``'s producer, each tried on ``step``; verified ones first.

    ``roots`` and ``last_good``: the watched models and their kept state, for ``lr`` after a divergence;
    ``data_code``: the records of the loop's data code, for a remedy at a producer there (remedies/data_code.py);
    ``reproduce``: the watch that localized the event without a step replay (``"per-call"``, ``"traced"``): an
    unremedied replay that does not go non-finite is said in a note (the tiered watch's replay reproduced the event
    already), and a module's producer whose op the per-call watch did not name too. ``in_loss``: a data event's
    producer whose value only the loss code read, run again ahead of it (:func:`_read_by_the_loss`).
    """
    if report.phase == Phase.DATA and not in_loss:
        skipped = _skip_batch(report, step)
        site = producer_site(report)
        if data_code is not None and report.op is not None and site.function in FUNCTIONS:
            return verified_first((*skipped, _data_code_trial(report, site, step, data_code)))
        return skipped
    site = producer_site(report)
    old_scale = collapsed_scale(report)
    if old_scale is not None:
        step = scaled(step, old_scale, old_scale)  # the replay unscales the gradients as the scaler did
    candidates = _candidates(report, site, step) if report.module is not None or _in_loss_code(report) or in_loss \
        else []
    diverged = report.cause is not None and report.cause.label == "learning-rate-too-high"
    if not candidates and old_scale is None and not diverged:
        if reproduce == "per-call" and report.op is None and report.module is not None and report.tensor.role in (
                TensorRole.MODULE_OUTPUT, TensorRole.OUTPUT_GRADIENT, TensorRole.PARAMETER_GRADIENT):
            # A module's computation whose op the per-call watch did not name (its deferred backward producer's).
            raise _NoTrial(Note("fixes-no-op"))
        if (none := none_fit(report)) is not None:
            raise _NoTrial(none)
        return ()
    base = replay_step(step, None, None)
    if reproduce and base.failed == "raised":  # not the event: the step, run again as it ran, raised
        raise _NoTrial(Note.of("fixes-replay-raised", error=f"{base.error[0]}: {base.error[1]}" if base.error else ""))
    if base.failed is None:  # the unremedied replay came out finite: nothing to fix on it
        # (Where the loss code ran its own autograd.grad, its recorded backward ops read what the model's forward
        # saved as it ran, not the copies' forward: the copies' gradients miss that derivative's part.)
        graph_grad = isinstance(step.loss_code, LossCode) and step.loss_code.differentiates
        raise _NoTrial(Note("fixes-not-reproduced-graph-grad" if graph_grad else "fixes-not-reproduced"))
    tries: list[tuple[str, _Try]] = [
        (kind, functools.partial(_remedy_trial, kind, remedy, report, site, step, base))
        for kind, remedy in candidates]
    if old_scale is not None:
        tries.append(("scale", lambda: _scale_trial(report, step, old_scale)))
    if diverged:
        tries.append(("lr", lambda: lr_trial(report, step, roots, last_good or LastGood(None), base)))
    budget = max(MIN_BUDGET, STEP_TIMES * base.seconds)
    spent = base.seconds
    trials: list[FixTrial] = []
    for kind, run in tries:
        if spent > budget:
            trials.append(at_producer(kind, report, reason=Note.of("time-budget", seconds=budget)))
            continue
        trials.append(run())
        spent += trials[-1].seconds
    return verified_first(trials)


def _data_code_trial(report: Report, site: Site, step: FailingStep, records: RegionRecords) -> FixTrial:
    """``eps`` at a producer in the data code: the batch made again with it (remedies/data_code.py), the step run."""
    remedy = DomainFix(site.function or "")
    at_line = InRecordedCode(site, remedy)
    remade = remedied_batch(step, records, at_line)
    named = (("function", remedy.function),)  # (an untried remedy is described by the function it would change)
    if isinstance(remade, Note):
        return at_producer("eps", report, facts=named, reason=remade)
    if not at_line.applied:
        return at_producer("eps", report, facts=named, reason=Note("nothing-to-change"))
    outcome = replay_step(remade, None, None)
    return at_producer("eps", report, facts=remedy_facts("eps", remedy, report, remade, outcome, None),
                       finite=outcome.failed is None, loss=outcome.loss, seconds=outcome.seconds,
                       failed=outcome.failed, error=outcome.error)


def _in_loss_code(report: Report) -> bool:
    """Whether the producer ran in the loss code: a forward op outside every module, or its gradient formula."""
    return report.module is None and report.phase in (Phase.FORWARD, Phase.BACKWARD)


def _remedy_trial(kind: str, remedy: Remedy, report: Report, site: Site, step: FailingStep,
                  base: StepOutcome) -> FixTrial:
    """A remedy applied at the producer's line (site.py) on a replay of the step."""
    outcome, remedy, every = stable_replay(step, site, remedy)  # (replay_at_line; an exp first as a softplus)
    if (wider := at_every_use(step, dataclasses.replace(site, module="") if every else site, remedy, outcome)):
        outcome, remedy = wider  # (the operand clamped at its other uses on the line too: remedies/every_use.py)
    facts = remedy_facts(kind, remedy, report, step, outcome, base) + ((("modules", "every"),) if every else ())
    if not outcome.applied or declined(remedy):
        reason = declined(remedy) or Note("nothing-to-change")
        if site.module is None and not isinstance(step.loss_code, LossCode):
            reason = Note.of("loss-code-not-rerun", reason=(step.loss_code or Note("no-loss-code-recorded")).pair)
        return at_producer(kind, report, facts=facts, seconds=outcome.seconds, reason=reason)
    if (unjudged_why := unjudged(step.loss_code, outcome.failed, outcome.loss_from,
                                 outcome.deliberate)) is not None:
        return at_producer(kind, report, facts=facts, loss=outcome.loss, seconds=outcome.seconds, reason=unjudged_why)
    if kind == "float32" and (refused := refused_upcast(outcome.error, report.dtype)) is not None:
        return at_producer(kind, report, facts=facts, seconds=outcome.seconds, reason=refused)
    # (checked where the trial ran: in every module that runs the line, where the producing module's alone failed)
    checked_at = dataclasses.replace(site, module="") if every else site
    other = changes_value(step, checked_at, remedy, outcome, every) if isinstance(remedy, StableFix) else None
    seconds = outcome.seconds + (remedy.checked if isinstance(remedy, StableFix) else 0.0)
    if other is not None:
        # Finite, by computing something else (a probability ratio divided by exp(its max)): no fix, and not
        # counted as one (finite None), with why.
        return at_producer(kind, report, facts=(*facts, ("changes_value", True)), loss=outcome.loss,
                           output_change=output_change(base, outcome), seconds=seconds, reason=other)
    finite = None if outcome.frozen and outcome.failed is None else outcome.failed is None  # (frozen: not a fix)
    return at_producer(kind, report, facts=facts, finite=finite, loss=outcome.loss,
                       output_change=output_change(base, outcome), seconds=seconds, failed=outcome.failed,
                       error=outcome.error)


def _scale_trial(report: Report, step: FailingStep, old: float) -> FixTrial:
    """``scale`` (remedies/scale.py): the step replayed at lower GradScaler scales until one is finite."""
    facts, outcome, seconds = try_scales(step, old)
    if outcome is None:
        return at_producer("scale", report, facts=tuple(facts.items()), seconds=seconds,
                           reason=Note.of("scale-at-most-one", scale=old))
    built = next((source for scaler in step.scalers if (source := scaler_source(scaler)) is not None), None)
    if built is not None:  # the edit goes at the line that built the scaler (patches/scaler.py)
        facts.update(scaler_file=built.filename, scaler_lineno=built.lineno, scaler_line=built.line)
    return at_producer("scale", report, facts=(*step_facts(step, outcome, report), *facts.items()),
                       finite=outcome.failed is None, loss=outcome.loss, seconds=seconds, failed=outcome.failed,
                       error=outcome.error)


def try_optimizer_fixes(report: Report, optimizers: Iterable[torch.optim.Optimizer], roots: Iterable[nn.Module],
                        last_good: LastGood) -> tuple[FixTrial, ...]:
    """An optimizer event's remedy (``lr``, the optimizer's ``eps``): its step redone from the last good state."""
    kind = _STEP_REMEDIES.get(report.cause.label if report.cause is not None else "")
    optimizer = next((opt for opt in optimizers if type(opt).__name__ == report.optimizer), None)
    if kind is None or optimizer is None:
        if (none := none_fit(report)) is not None:
            raise _NoTrial(none)
        return ()
    try:
        reason, finite, facts, seconds = redo_step(optimizer, roots, last_good, kind, report)
    except (TypeError, ValueError, KeyError, RuntimeError) as error:  # an optimizer not rebuilt from its groups
        reason, finite, facts, seconds = Note.of("optimizer-not-rebuilt", problem=str(error)), None, {}, 0.0
    if kind == "lr" and not math.isfinite(facts.get("lr", 0.0)):
        # A tenth of a NaN or infinite learning rate is one too: the cause's remedy is a finite one.
        reason, finite, seconds = Note.of("lr-not-finite", lr=float(facts["lr"])), None, 0.0
        facts = {}
    facts_of = (("optimizer", report.optimizer), ("stepped", True), *facts.items())
    return (at_producer(kind, report, facts=facts_of, finite=finite, seconds=seconds,
                    failed=None if finite is not False else "optimizer step", reason=reason),)


def _skip_batch(report: Report, step: FailingStep) -> tuple[FixTrial, ...]:
    """``skip-batch`` (remedies/batch.py): the step without the samples whose data is non-finite; not offered for a
    tensor the loop trains (a soft prompt), whose rows are no samples."""
    if batches.trained_argument(step):
        return ()
    if batches.sparse_nonfinite(step):
        return (at_producer("skip-batch", report, reason=Note("sparse-batch")),)
    left = batches.without_bad_samples(step)
    if left is None:
        return (at_producer("skip-batch", report, reason=Note("no-sample-left-out")),)
    smaller, dropped, size = left
    outcome = replay_step(smaller, None, None)
    facts = (*step_facts(smaller, outcome, report), ("dropped", dropped[:16]), ("left_out", len(dropped)),
             ("batch", size))
    return (at_producer("skip-batch", report, facts=facts, finite=outcome.failed is None, loss=outcome.loss,
                    seconds=outcome.seconds, failed=outcome.failed, error=outcome.error),)
