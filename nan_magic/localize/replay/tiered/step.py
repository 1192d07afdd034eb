"""Tier 2 of the default watch: replay the failing step's model call to name the producer.

The default (tiered) watch checks only a step's boundaries: the batch entering each watched model, the model's
outputs, the loss, the gradient flowing into the outputs, the parameter gradients and the parameters (watch.py). A
NaN, once born, reaches one of them; the search for where it was born is paid only for the step that failed. For that,
:class:`StepReplays` keeps, for the current step only, what a replay of each top-level model call needs:

* its arguments (alive for the step anyway) and their version counters, to know whether they were modified in place
  since;
* the CPU and CUDA generators' state and the autocast regions at its start, and whether gradients were enabled;
* copies of the buffers the call may change, as they were before it (BatchNorm's running statistics): all of them at
  a model's first call, afterwards those whose version counter an earlier call moved;
* the gradient that flowed into its outputs (for a backward event).

At a non-benign forward or backward event, :meth:`StepReplays.localize` runs that call again, eagerly (a compiled
model's ``_orig_mod``, DDP's ``module``), under a nested watch with ``mode="full", ops=True``: per-module records and
the op tracer, the producer rule of PRODUCT.md. For a backward event it then runs ``torch.autograd.grad`` from the
replayed outputs with the captured gradients, into scratch gradients: never ``.grad``, and no accumulate-grad hook
fires (DDP's reducer stays quiet). The replay leaves no trace: copies of the arguments and buffers, the user's
generators put back afterwards, the outer watch standing aside, and what the forward writes in place or changes in the
modules' Python state put back (replay/untouched.py).

The report is the nested watch's, for the same step. It says whether the replay *reproduced* the event (the same
boundary with the same counts); when it did not (a non-deterministic kernel, inputs modified since, side effects), the
report is what the boundary check saw, and says so.

The keeping (tier 1, every step) is :mod:`~nan_magic.localize.replay.tiered.step_keeping`, a mixin of
:class:`StepReplays`;
this module is the replay at an event (tier 2).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from nan_magic.explain.diagnose import diagnose
from nan_magic.hot.checks.early import WARN_EVERY
from nan_magic.hot.kept.buffer_copies import BufferCopies
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.kept.parameter_writes import Written
from nan_magic.hot.kept.rng import ModelStates
from nan_magic.hot.reads import version_of
from nan_magic.localize.replay.buffer_writes import buffer_written
from nan_magic.localize.replay.fused import apart_note, fast_path_off, is_fused
from nan_magic.localize.replay.line_replay import LineStop
from nan_magic.localize.replay.seen_again import kinds_unexplained, same_counts
from nan_magic.localize.replay.tiered.root_calls import NestedWatch, Outcome, RootCall, replay_target, rerun
from nan_magic.localize.replay.tiered.step_keeping import _NO_PARAMETERS, MAX_CALLS, StepKeeping, _Cycle
from nan_magic.options import WatchConfig
from nan_magic.plain import to_pairs
from nan_magic.records import Cause, EarlyWarning, Note, Phase, Report, TensorRef, TensorRole

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nan_magic.errors.exceptions import NonFiniteError
    from nan_magic.hot.kept.call_records import Call
    from nan_magic.hot.watched.targets import Targets
    from nan_magic.localize.replay.producer_call import CallReplay
    from nan_magic.records import EarlyWarning, StepSummary

__all__ = ["Producer", "ReplayHost", "StepReplays"]

#: The frame that ran a producing op, and where it was then: ``(frame, (f_lasti, f_lineno))`` (frames.py).
Producer = tuple[FrameType | None, tuple[int, int] | None]


class ReplayHost(Protocol):
    """What a step replay reads of the watch it replays for (lifecycle/watch.py)."""

    @property
    def config(self) -> WatchConfig: ...

    @property
    def targets(self) -> Targets: ...

    @property
    def cycle(self) -> _Cycle: ...

    @property
    def call_replay(self) -> CallReplay: ...

    @property
    def raised(self) -> NonFiniteError | None: ...

    @property
    def step(self) -> int: ...

    @property
    def history(self) -> Iterable[StepSummary]: ...

    @property
    def warnings(self) -> Iterable[EarlyWarning]: ...

    def parameters_before_update(self) -> dict[int, torch.Tensor]: ...

    def values_before_update(self) -> dict[int, tuple[torch.Tensor, int]]: ...


class StepReplays(StepKeeping):
    """The top-level calls of the current step, and their replay at an event."""

    watch: ReplayHost

    def __init__(self, watch: ReplayHost, nested: NestedWatch) -> None:
        self.watch = watch
        self._nested = nested
        self.calls: deque[RootCall] = deque(maxlen=MAX_CALLS)
        # Deferred: gradients into the outputs of calls let go of (over MAX_CALLS a step), held for the check to count
        # them; at most MAX_CALLS (StepKeeping.capture_gradient).
        self._let_go_grads: list[torch.Tensor] = []
        # Per model: its buffers' slots, and which buffers its calls change (None: not learned yet).
        # (Owners and names apart: a model's plain dicts are read by map(dict.get, ...) in C, no Python call each.)
        # The slots hold its BatchNorms' step counters: changed, never copied after the first call (counted_back);
        # they end with the parameters its forward writes in place, in eval and in training mode (None: not learned
        # yet), learned at its first call in each (written_parameters).
        self._slots: dict[int, tuple[list[Any], list[str], bool, frozenset[int], list[Written | None]]] = {}
        self._mutable: dict[int, set[int] | None] = {}
        # Parameters that an optimizer stepped since the step began (release_stepped; a layout's set, as it is).
        self._stepped: frozenset[int] = _NO_PARAMETERS
        # Per model: its trainable parameters, learned at its first call (release_stepped).
        self._trainable: dict[int, frozenset[int]] = {}
        # Per model: whether its forward is torch's own code (an nn.Sequential, a compiled wrapper), learned at
        # its first call: then no op of a replay has a user frame inside the model, and the call's line is kept.
        self._library_forward: dict[int, bool] = {}
        # Models whose forward was seen writing its own input in place (a version counter moved across a call):
        # their calls keep a copy of it (hot/kept/input_writes.py).
        self._writes_input: set[int] = set()
        self._buffer_copies = BufferCopies()
        # Per model: the user's own generators its calls keep the states of (hot/kept/generators.py), found at its
        # first call among its modules' attributes, and learned from a replay that drew from another.
        self._generators: dict[int, list[torch.Generator]] = {}
        self._states = ModelStates()
        #: The call whose replay named the last event's producer (the fix trials replay it: fixes/step.py).
        self.replayed: RootCall | None = None
        #: ... and where it named it only with the parameters as the call read them (:meth:`_run_as_read`), those,
        #: by parameter id: the fix trials start from them too (fixes/runner.py), not from the ones the loop restored.
        self.read_parameters: dict[int, torch.Tensor] = {}
        #: Each call keeps the count of autograd nodes made before it (ops mode only: replay/line_replay.py).
        self.counts_nodes = False


    def localize(self, finding: Finding, seen: Report) -> tuple[Report, Producer]:
        """The report of a tier-1 event ``seen``: the replay's where it reproduced the event, else ``seen``."""
        self.read_parameters = {}
        if finding.tensor.role is TensorRole.BUFFER and finding.call is None:
            # A running statistic read at the optimizer step: the step's model calls, run again from their buffers
            # as they were before them, name the op that wrote it (replay/buffer_writes.py).
            aside = self.watch.call_replay.standing_aside
            return buffer_written(self.calls, finding, seen, aside), (finding.frame, None)
        if finding.in_graph_grad:
            # The loop's own autograd.grad(create_graph=True) made it (MAML's inner step), its gradient formula's op
            # recorded as loop code: the model calls' backward, replayed from the gradients that grad sent into their
            # outputs, names the formula, its module and forward line; where it does not, the recorded op stands.
            candidates = [root for root in reversed(self.calls) if root.output_grads]
            backward, boundary = True, None
        elif finding.phase == Phase.FORWARD and finding.call is not None and finding.call.info is not None and (
                finding.call.phase != Phase.DATA):  # (a batch the model's own code made: bypassed.py named the op)
            top = finding.call
            while top.parent is not None:
                top = top.parent
            candidates = [root for root in self.calls if root.call is top]
            backward = False
            # On a per-module step the boundary may be a submodule's output: the replay's report then
            # stands for it (the replay measures the model's outputs only).
            boundary = finding.tensor if finding.call is top else None
        elif finding.phase == Phase.BACKWARD and finding.op is None and (  # (an op named: the loss code's backward)
                finding.call is None or finding.call.info is not None or finding.unconfirmed_outside):
            # Backward runs the last call first; each call's gradients are replayed apart.
            candidates = [root for root in reversed(self.calls) if root.output_grads]
            backward = True
            boundary = finding.tensor
        else:  # data, the loss code's forward or backward, the optimizer: the boundary check named it
            return seen, (finding.frame, None)
        if candidates and replay_target(candidates[0].module) is None:
            return seen, (finding.frame, None)  # FSDP: every step is a per-module step, which named the module
        if (finding.unconfirmed_outside or finding.in_graph_grad) and not candidates:
            return seen, (finding.frame, None)
        if not candidates:
            why = Note("no-gradient-held") if backward else Note.of("call-not-held", max_calls=MAX_CALLS)
            return self._not_replayed(seen, why), (finding.frame, None)
        outcome, root = Outcome(), candidates[0]
        self._inputs_as_read(candidates)
        # torch's anomaly mode stopped the user's backward at the first node that returned NaN, which may be one
        # that a later node's backward zeroes (no boundary sees it): the replay names the first op that made one.
        anomaly = backward and any(note.kind == "anomaly-raised" for note in finding.notes)
        for root in candidates:
            outcome = self._run(root, backward, boundary, anomaly)
            if outcome.report is not None:
                break
        if outcome.report is None and outcome.benign is None and not backward:
            outcome = self._run_as_read(candidates[0], boundary) or outcome
        if outcome.report is not None and not backward and is_fused(outcome.report.op):
            outcome = self._run_apart(root, boundary, seen, outcome.report.op) or outcome
        if outcome.report is None and outcome.benign is not None:
            if lacking := kinds_unexplained(outcome.boundary, seen):
                # A kind the deliberate infinity does not make (a NaN never is): the replay ran from state the loop
                # changed since (an attribute, by the deferred check), so the event is raised, not taken as benign.
                found = outcome.benign
                return self._not_replayed(seen, Note.of("benign-replay-lacks", kinds=lacking, nan=found.nan,
                    posinf=found.posinf, neginf=found.neginf, where=found.where)), (finding.frame, None)
            # The value is a deliberate infinity (a masked_fill(mask, -inf) the model returns): benign.
            return self._replayed(outcome.benign, seen.step), (None, None)
        if outcome.report is None or (finding.unconfirmed_outside and outcome.report.module is None) or (
                finding.in_graph_grad and (outcome.report.op is None or outcome.report.phase != Phase.BACKWARD)):
            if finding.unconfirmed_outside or finding.in_graph_grad:
                # No model's backward made it either: the code outside them stays the likeliest producer.
                return seen, (finding.frame, None)
            return self._not_replayed(seen, outcome.why_not or Note("step-replay-finite")), (finding.frame, None)
        if not backward:
            # The scene (dump=) saves this call's inputs and generators to replay it from (scene.py).
            finding.rng_state = root.rng
        if outcome.unkept:
            # It drew from a generator whose state at the call was not kept: other numbers, whatever it made (a
            # boundary of one non-finite scalar, a model's loss, reads the same count from any draw).
            return self._not_replayed(seen, Note("generator-not-kept")), (finding.frame, None)
        if not same_counts(outcome.boundary, seen):
            found = outcome.report
            return self._not_replayed(seen, Note.of(
                "other-counts", nan=found.nan, posinf=found.posinf, neginf=found.neginf, tensor=to_pairs(found.tensor),
                where=found.where, phase=str(found.phase), op=found.op, seen=to_pairs(seen.tensor),
            )), (finding.frame, None)
        report = self._replayed(outcome.report, seen.step, seen)
        if (debug := outcome.debug_note) is not None:  # where %debug opens: a replay of this step's call, or why not
            report = dataclasses.replace(report, note_facts=(*report.note_facts, debug.adding(step=seen.step)))
        self.replayed = root
        finding.frame_calls = outcome.calls  # the traceback's frames from the loop to the producer (events.emit)
        if finding.cause is not None:
            # The boundary check settled the cause (a GradScaler whose scale collapses): the replay adds where.
            report = dataclasses.replace(report, cause=seen.cause, note_facts=(*seen.note_facts, *report.note_facts))
        return report, (outcome.frame, outcome.position)

    def explain_failure(self, module: nn.Module, call: Call, running: tuple[tuple[Any, ...], dict[str, Any]] | None
                        ) -> tuple[Report, Producer, BaseException] | None:
        """A top-level forward raised: whether a non-finite value came first, and its producer.

        ``torch.multinomial`` on NaN probabilities, an index computed from a NaN: the exception stops the forward
        before its outputs reach the boundary check, so the call is replayed; None when the replay meets no non-finite
        value before the same exception.
        """
        error = sys.exc_info()[1]
        root = self._latest(module)
        if error is None or root is None or self.watch.raised is not None:
            # (our own NonFiniteError on its way out and linalg's verdicts are not replayed: raised.py)
            return None
        self.finish(module, running[1] if running is not None else {})
        outcome = self._run(root, False, None)
        if outcome.report is None:
            return None
        report = self._replayed(outcome.report, self.watch.step)
        report = dataclasses.replace(report, note_facts=(*report.note_facts, Note.raised("forward-raised", error)))
        return report, (outcome.frame, outcome.position), error

    def _inputs_as_read(self, roots: list[RootCall]) -> None:
        """An argument of a kept call that the loop's update code has written in place since (the next batch copied
        into the static input buffer before ``opt.step()``, where the deferred check runs) starts the replay from the
        copy the update region took before that write, where the copy is the value the call read (its version then
        is the one the call began with). Kept on the call (``inputs_before``): the fix trials start from it too."""
        before = self.watch.values_before_update()
        if not before:
            return
        for root in roots:
            kept = {id(tensor) for tensor, _copy in root.inputs_before}
            found = tuple((tensor, entry[0]) for tensor, version in root.versions
                          if id(tensor) not in kept and (entry := before.get(id(tensor))) is not None
                          and entry[1] == version and version_of(tensor) != version)
            if found:
                root.inputs_before = (*root.inputs_before, *found)

    def _run_as_read(self, root: RootCall, boundary: TensorRef | None) -> Outcome | None:
        """The forward replay of ``root`` stayed finite: again with the parameters as the call read them, where the
        loop's update code has written them in place since (SAM's ``p.sub_(e)`` restoring ``w`` after the second
        forward, before the deferred check at the step); None where it wrote none of the call's model.

        Each parameter's memory is swapped (``p.data``, no version counter moved) for the copy the update region
        took before its first write, and put back, the same tensor, whatever the replay does.
        """
        before = self.watch.parameters_before_update()
        swapped = [(p, p.data) for p in root.module.parameters() if id(p) in before] if before else []
        if not swapped:
            return None
        try:
            for parameter, _data in swapped:
                parameter.data = before[id(parameter)]
            outcome = self._run(root, False, boundary)
        finally:
            for parameter, data in swapped:
                parameter.data = data
        if outcome.report is None:
            return None
        self.read_parameters = {id(parameter): before[id(parameter)] for parameter, _data in swapped}
        return outcome

    def _run_apart(self, root: RootCall, boundary: TensorRef | None, seen: Report, fused: str | None
                   ) -> Outcome | None:
        """The replay named a fused inference layer (replay/fused.py): again with the fast path off, where that
        replay makes the same values at the boundary; else None, and the fused op stands."""
        with fast_path_off():
            outcome = self._run(root, False, boundary)
        if outcome.report is None or not same_counts(outcome.boundary, seen):
            return None
        notes = (*outcome.report.note_facts, apart_note(fused))
        return dataclasses.replace(outcome, report=dataclasses.replace(outcome.report, note_facts=notes))

    def _run(self, root: RootCall, backward: bool, boundary: TensorRef | None, anomaly: bool = False) -> Outcome:
        outcome = rerun(root, backward, boundary, self.model_of(root.module), self.watch.config,
                        self.watch.call_replay.standing_aside, self._nested, anomaly)
        if outcome.unkept:
            self.learn_generators(root.module, outcome.unkept)
        return outcome

    def run_to_line(self, root: RootCall, stop: LineStop) -> None:
        """Replay ``root``'s forward as a backward replay runs it, to the end of ``stop``'s line (line_replay.py)."""
        rerun(root, False, None, self.model_of(root.module), self.watch.config, self.watch.call_replay.standing_aside,
              self._nested, stop=stop)

    def model_of(self, module: nn.Module) -> nn.Module | None:
        """The eager model (replay_target) of the watched root that holds ``module``."""
        for _label, root in self.watch.targets.roots:
            if root is module or any(sub is module for sub in root.modules()):
                return replay_target(root)
        return None

    def _replayed(self, report: Report, step: int, seen: Report | None = None) -> Report:
        """The replay's report for ``step``; ``seen``, the boundary's report, adds the facts the replay lacks.

        The replay runs the model call only: the optimizer that was about to
        step with the gradient is known to the boundary check alone.
        """
        watch = self.watch
        # How the event was met, which the replay cannot know: torch's anomaly mode stopped the user's backward.
        met = tuple(note for note in seen.note_facts if note.kind == "anomaly-raised") if seen else ()
        replayed = report
        report = dataclasses.replace(
            report,
            step=step,
            autograd_node=report.autograd_node or (seen.autograd_node if seen else None),
            optimizer=report.optimizer or (seen.optimizer if seen else None),
            # (the watched optimizers' weight decay, read as the step's check saw the event: the nested watch has none)
            optimizer_decay=report.optimizer_decay or (seen.optimizer_decay if seen else None),
            history=tuple(watch.history),
            warnings=tuple(watch.warnings),
            reproduced=True,
            models_watched=len(watch.targets.roots),
            ops=watch.config.ops,
            note_facts=(*report.note_facts, Note.of("step-replayed", step=step), *met),
        )
        # The cause reads the run's history (a diverging loss), which the replay did not have.
        cause = diagnose(report)
        batch = _batch_warnings(replayed, watch.warnings, step) if _divides_by_the_batch(cause) else ()
        return dataclasses.replace(report, cause=cause, warnings=(*report.warnings, *batch))

    @staticmethod
    def _not_replayed(seen: Report, why: Note) -> Report:
        # (Unseen: torch's anomaly mode stopped the backward before any check; a mode="full" watch would not see it.)
        # (Inputs written in place since the call: a mode="full" replay starts from the same written values; only
        # the op tracer, which sees the write as it runs, can name it.)
        # (A generator whose state was not kept: a mode="full" replay draws other numbers too; ops=True sees the op.)
        note = Note.of("not-reproduced-unseen" if seen.unlocated else "not-reproduced-inputs"
                       if why.kind == "inputs-modified" else "not-reproduced-generator"
                       if why.kind == "generator-not-kept" else "not-reproduced", reason=why.pair)
        return dataclasses.replace(seen, reproduced=False, note_facts=(*seen.note_facts, note))


#: The readings of a division by a zero the batch can make (a per-batch std or variance, a norm without eps): a
#: feature constant over the failing step's batch is the reason for these only (not a log's zero, not a weight's).
_BATCH_DIVISIONS = frozenset({"division-by-zero", "rsqrt-zero", "norm-eps-zero"})


def _divides_by_the_batch(cause: Cause) -> bool:
    return cause.label == "division-by-zero" and cause.reading in _BATCH_DIVISIONS


def _batch_warnings(replayed: Report, seen: Iterable[EarlyWarning], step: int) -> tuple[EarlyWarning, ...]:
    """The replay's reading of the failing step's own batch (a feature constant over it), as of ``step``.

    The watch reads a batch's features at its first step and every 8th only (hot/checks/early.py); the replay is the
    failing step's first, so it read them: a per-batch standardisation that divides by a column constant in batch 3
    is told which column, as it is at step 0. Not where the watch said it of this step already, nor where it said
    the same columns within its repeat limit (:data:`~nan_magic.hot.checks.early.WARN_EVERY` steps).
    """
    seen = tuple(seen)  # (read twice below)
    if any(warning.kind == "constant-feature" and warning.step == step for warning in seen):
        return ()
    said = {(warning.facts, warning.value) for warning in seen
            if warning.kind == "constant-feature" and 0 <= step - warning.step < WARN_EVERY}
    return tuple(dataclasses.replace(warning, step=step) for warning in replayed.warnings
                 if warning.kind == "constant-feature" and (warning.facts, warning.value) not in said)
