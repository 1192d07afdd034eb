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
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import weakref
from collections import deque
from collections.abc import Iterable
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from nan_magic.errors.frames import is_library_code
from nan_magic.explain.diagnose import diagnose
from nan_magic.hot.kept.buffer_copies import BufferCopies, ScriptedBuffers, step_counters, with_versions
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.kept.lines import line_at
from nan_magic.hot.kept.parameter_writes import Written, written_parameters_after, written_parameters_before
from nan_magic.hot.kept.rng import ModelStates, RngState, any_autocast, capture_autocast
from nan_magic.hot.reads import iter_tensors, version_of
from nan_magic.localize.replay.buffer_writes import buffer_written
from nan_magic.localize.replay.line_replay import LineStop, nodes_made
from nan_magic.localize.replay.root_calls import NestedWatch, Outcome, RootCall, replay_target, rerun
from nan_magic.localize.replay.seen_again import kinds_unexplained, same_counts
from nan_magic.options import WatchConfig
from nan_magic.patches.functional_calls import SWAPPED_OUT
from nan_magic.plain import to_pairs
from nan_magic.records import Note, Phase, Report, TensorRef, TensorRole

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nan_magic.errors.exceptions import NonFiniteError
    from nan_magic.hot.kept.call_records import Call
    from nan_magic.hot.watched.targets import ModuleInfo, Targets
    from nan_magic.localize.replay.producer_call import CallReplay
    from nan_magic.records import EarlyWarning, StepSummary

__all__ = ["Producer", "ReplayHost", "StepReplays"]

#: The frame that ran a producing op, and where it was then: ``(frame, (f_lasti, f_lineno))`` (frames.py).
Producer = tuple[FrameType | None, tuple[int, int] | None]

#: Top-level calls kept at most (a GAN's two models, a siamese model called twice, a few
#: micro-batches of gradient accumulation); older ones are dropped and cannot be replayed. A call
#: is released when an optimizer has stepped every trainable parameter of its model.
MAX_CALLS = 8


class _Timing(Protocol):
    @property
    def deferred(self) -> bool: ...


class _Cycle(Protocol):
    trains: bool

    @property
    def timing(self) -> _Timing: ...

    def training(self) -> bool: ...

    def sync(self) -> list[float]: ...


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


# Code objects of the frames between the watch's pre-hook and the user's line (torch's, ours), and the user's:
# the walk of each top-level call asks sets, not a function per frame, once a code object is known.
_PASSED: set[CodeType] = set()
_NO_PARAMETERS: frozenset[int] = frozenset()
_USERS: set[CodeType] = set()


def _calling_frame(frame: FrameType | None) -> FrameType | None:
    """The user's frame at or above ``frame`` (errors/frames.user_line, cached by code object)."""
    while frame is not None:
        code = frame.f_code
        if code in _USERS:
            return frame
        if code in _PASSED:
            frame = frame.f_back
        else:
            (_PASSED if is_library_code(code) else _USERS).add(code)
    return None


class StepReplays:
    """The top-level calls of the current step, and their replay at an event."""

    def __init__(self, watch: ReplayHost, nested: NestedWatch) -> None:
        self.watch = watch
        self._nested = nested
        self.calls: deque[RootCall] = deque(maxlen=MAX_CALLS)
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
        self._buffer_copies = BufferCopies()
        self._states = ModelStates()
        #: The call whose replay named the last event's producer (the fix trials replay it: fixes/step.py).
        self.replayed: RootCall | None = None
        #: Each call keeps the count of autograd nodes made before it (ops mode only: replay/line_replay.py).
        self.counts_nodes = False

    # -- tier 1: keeping what a replay needs --------------------------------------------

    def begin(self, module: nn.Module, info: ModuleInfo, call: Call, args: tuple[Any, ...],
              checkable: bool | None = None) -> RngState:
        """A top-level call of a watched model starts (its forward pre-hook); ``call`` is the watch's record.

        Returns the generators' state taken for it (the call's own replay uses the same). ``checkable``:
        ``model(x)``'s ``is_checkable(x)``, asked by the hook already (None: another form of call).
        """
        model = id(module)
        slots = self._slots.get(model)
        if slots is None:
            found = [
                (owned if type(owned := owner._buffers) is dict else ScriptedBuffers(owned), name)
                # (keys(): a scripted module's buffers cannot be iterated by name)
                for owner in module.modules() for name in owner._buffers.keys()  # noqa: SIM118
            ]
            owners = [owner for owner, _name in found]
            slots = self._slots[model] = (owners, [name for _owner, name in found],
                                          all(type(owner) is dict for owner in owners), step_counters(module),
                                          [None, None])
            self._trainable[model] = _trainable(module)
            self._library_forward[model] = is_library_code(type(module).forward.__code__)
        training = module.training
        written = slots[4][training]
        parameters: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        learning = None
        if written is None:  # its first call in this mode: which parameters does its forward write in place?
            learning = written_parameters_before(module, training)
        elif written:  # (the usual model writes none: nothing copied, not even a tuple made)
            parameters = tuple((parameter, parameter.detach().clone()) for parameter in written)
        if slots[1]:
            mutable = self._mutable.get(model)
            owners, names, plain, counters, _written = slots
            present = [buffer for buffer in map(_dict_get, owners, names) if buffer is not None] if plain else [
                buffer for owner, name in zip(owners, names) if (buffer := owner.get(name)) is not None]
            buffer_versions = with_versions(present)
            live = dict(zip(map(id, present), present)) if mutable is None else {
                key: buffer for key, buffer in zip(map(id, present), present) if key in mutable}
            # (A BatchNorm model in training changes only its step counters after the first call: no copy at all.)
            buffers = self._buffer_copies.take(module, live) if live else {}
        else:  # a model without buffers (an MLP, a transformer with LayerNorm): none to copy or follow
            buffer_versions, live, buffers, counters = [], {}, {}, _NO_PARAMETERS
        if checkable:  # (``model(x)``: no walk of the arguments; version_of inlined)
            try:
                versions = [(args[0], args[0]._version)]
            except RuntimeError:  # an inference tensor has no version counter
                versions = [(args[0], 0)]
        elif checkable is not None:
            versions = []
        else:
            versions = [(tensor, version_of(tensor)) for _path, tensor in iter_tensors(args)]
        rng = self._states.take(module)  # (once for a Sequential that draws nothing: rng.py)
        caller = _calling_frame(sys._getframe(2))  # frame 1 is the watch's pre-hook; torch's _call_impl called it
        line = line_at(caller) if caller is not None else 0  # (f_lineno scans the code's line table: lines.py)
        calls = self.calls
        if len(calls) == MAX_CALLS and (cycle := self.watch.cycle).timing.deferred:
            # The oldest call is let go now; judged after, no replay could call its -inf deliberate (a rollout's
            # masked logits) or name a NaN's op. So the step is judged now: a host read per MAX_CALLS calls more.
            cycle.sync()
        calls.append(RootCall(
            module=module,
            info=info,
            args=args,
            rng=rng,
            grad_enabled=torch.is_grad_enabled(),
            autocast=capture_autocast() if any_autocast() else None,  # (the usual step's None, with no call more)
            buffers=buffers,
            buffer_sources=list(live.values()),
            versions=versions,
            buffer_versions=buffer_versions,
            counters=counters,
            call=call,
            site=(caller.f_code, line, caller.f_globals)
            if caller is not None and self._library_forward[model] else None,
            caller=(caller.f_code, id(caller), caller.f_lasti, line) if caller is not None else None,
            nodes_before=nodes_made() if self.counts_nodes else None,
            parameters=parameters,
            learning=learning,
            # (a list's truth, no call: MAML's loops alone have a swap in progress)
            in_functional_call=any(swapped is module for swapped, _own in SWAPPED_OUT) if SWAPPED_OUT else False,
        ))
        return rng

    def arguments_of(self, call: Call) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A held top-level call's arguments as it was made (the scene saves its plain ones); None if not held."""
        root = next((root for root in self.calls if root.call is call), None)
        return (root.args, root.kwargs) if root is not None else None

    def finish(self, module: nn.Module, kwargs: dict[str, Any], output: Any = None) -> None:
        """The top-level call returned (or raised): note its keyword arguments, and what its buffers did."""
        calls = self.calls  # (the latest call first, inlined: the usual step's one call is it)
        root = calls[-1] if calls and calls[-1].module is module else self._latest(module)
        if root is None or root.returned:
            return
        root.returned = True
        root.kwargs = dict(kwargs)
        if root.grad_enabled and not ((cycle := self.watch.cycle).trains or cycle.training()):
            # Only an inference step drops its calls when the next step begins (new_step): training keeps them anyway.
            root.outputs = [weakref.ref(tensor) for _path, tensor in iter_tensors(output, attributes=True)
                            if tensor.grad_fn is not None]
        if kwargs:
            root.versions += [(tensor, version_of(tensor)) for _path, tensor in iter_tensors(kwargs)]
        if root.learning is not None:
            training, written = written_parameters_after(root.learning)
            self._slots[id(module)][4][training] = written
        if not root.buffer_versions:  # (a model without buffers: nothing moved, nothing to learn)
            if id(module) not in self._mutable:
                self._mutable[id(module)] = set()
            return
        try:  # (``_version`` read directly: this runs at every top-level call; an inference tensor has none)
            moved = {id(buffer) for buffer, version in root.buffer_versions if buffer._version != version}
        except RuntimeError:
            moved = {id(buffer) for buffer, version in root.buffer_versions if version_of(buffer) != version}
        if root.counters:  # (a BatchNorm's step counter is counted back at a replay, not copied: counted_back)
            moved -= root.counters
        known = self._mutable.get(id(module))
        self._mutable[id(module)] = moved | (known or set())

    def capture_gradient(self, call: Call, path: str, grad: torch.Tensor) -> None:
        """The gradient flowing into output ``path`` of a top-level call (its tensor hook)."""
        for root in self.calls:
            if root.call is call:
                root.output_grads[path] = grad
                return

    def clear(self) -> None:
        """The watch ends: nothing can need a replay any more."""
        self.calls.clear()
        self._stepped = _NO_PARAMETERS
        self._buffer_copies.clear()

    def new_step(self, training: bool) -> None:
        """A step begins: inference steps drop the last step's calls; training keeps the calls not yet stepped.

        A call still waiting from an earlier step is one whose model's trainable parameters (learned at its first
        call) no optimizer stepped: they may have changed since (a layer unfrozen, an embedding resized), so they are
        learned again.
        """
        if self._stepped:
            self._stepped = _NO_PARAMETERS
        if not self.calls:  # (a training step released its calls as its optimizer stepped: nothing to learn)
            return
        if not training:
            # Inference: the last step's calls are dropped as the next step begins, each unless a backward
            # may still reach it (a GAN's generator called before the discriminator, while no optimizer
            # has stepped yet; a siamese model's first call): then it stays while an output with a graph lives.
            waiting = [root for root in self.calls if root.awaits_backward()]
            self._keep(waiting)
        for module in {id(root.module): root.module for root in self.calls}.values():
            self._trainable[id(module)] = _trainable(module)

    def release_stepped(self, opt: torch.optim.Optimizer, ids: frozenset[int] | None = None) -> None:
        """``opt`` stepped: drop the calls of models with nothing left to step this step.

        A call is kept while its model has a trainable parameter that no optimizer stepped since the step began: a
        GAN's generator call, made before the discriminator's step, waits for its own optimizer (its backward may
        still fail). A model without trainable parameters (a frozen teacher) is dropped at the first step. The
        trainable parameters are those of the model's first call in the watch (a set per model, not a walk of its
        parameters each step), learned again for a call still waiting when the next step begins (new_step).
        ``ids``: the ids of ``opt``'s parameters, as its pre-hook's layout holds them (a set made once a
        layout, hot/checks/layouts.py: none is built here each step); None: read from its groups.
        """
        if ids is None:
            groups = opt.param_groups
            ids = frozenset(map(id, groups[0]["params"] if len(groups) == 1
                                else itertools.chain.from_iterable(group["params"] for group in groups)))
        self._stepped = stepped = ids if not self._stepped else self._stepped | ids
        calls = self.calls
        if len(calls) == 1:  # (the usual step, one model call: no list of the waiting ones, no _keep)
            root = calls[0]
            if self._trainable.get(id(root.module), _NO_PARAMETERS) <= stepped:
                if root.buffers and self._mutable.get(id(root.module)):  # (copies a next call will copy into)
                    self._buffer_copies.recycle(((root.module, root.buffer_sources, root.buffers),))
                self.calls = deque(maxlen=MAX_CALLS)
            return
        waiting = [root for root in calls if not self._trainable.get(id(root.module), _NO_PARAMETERS) <= stepped]
        self._keep(waiting)

    def _keep(self, waiting: list[RootCall]) -> None:
        """Keep only the ``waiting`` calls; the buffer copies of the others are free for the next calls."""
        if len(waiting) != len(self.calls):
            # (Every call released, the usual training step: no test of each against the waiting ones.)
            released = self.calls if not waiting else [
                root for root in self.calls if not any(root is kept for kept in waiting)]
            for root in released:
                # (Copies a next call will copy into: none where its calls change no buffer it copies, a BatchNorm
                # model's after its first call, whose copies of every buffer are then let go, not kept for the watch.)
                if root.buffers and self._mutable.get(id(root.module)):
                    self._buffer_copies.recycle(((root.module, root.buffer_sources, root.buffers),))
            self.calls = deque(waiting, maxlen=MAX_CALLS)

    def _latest(self, module: nn.Module) -> RootCall | None:
        return next((root for root in reversed(self.calls) if root.module is module), None)

    # -- tier 2: the replay ---------------------------------------------------------------

    def localize(self, finding: Finding, seen: Report) -> tuple[Report, Producer]:
        """The report of a tier-1 event ``seen``: the replay's where it reproduced the event, else ``seen``."""
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
        elif finding.phase == Phase.FORWARD and finding.call is not None and finding.call.info is not None:
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
        # torch's anomaly mode stopped the user's backward at the first node that returned NaN, which may be one
        # that a later node's backward zeroes (no boundary sees it): the replay names the first op that made one.
        anomaly = backward and any(note.kind == "anomaly-raised" for note in finding.notes)
        for root in candidates:
            outcome = self._run(root, backward, boundary, anomaly)
            if outcome.report is not None:
                break
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
        if error is None or root is None or self.watch.raised is not None or isinstance(error, FloatingPointError):
            return None  # no exception, or our own NonFiniteError (a FloatingPointError) on its way out
        if isinstance(error, torch.linalg.LinAlgError):
            # linalg's verdict on its matrix (singular, not positive-definite): the NaN its ``_ex`` kernel made
            # inside never reached the user's code, and ``except LinAlgError`` must still catch it.
            return None
        self.finish(module, running[1] if running is not None else {})
        outcome = self._run(root, False, None)
        if outcome.report is None:
            return None
        report = self._replayed(outcome.report, self.watch.step)
        report = dataclasses.replace(report, note_facts=(*report.note_facts, Note.raised("forward-raised", error)))
        return report, (outcome.frame, outcome.position), error

    def _run(self, root: RootCall, backward: bool, boundary: TensorRef | None, anomaly: bool = False) -> Outcome:
        return rerun(root, backward, boundary, self.model_of(root.module), self.watch.config,
                     self.watch.call_replay.standing_aside, self._nested, anomaly)

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
        report = dataclasses.replace(
            report,
            step=step,
            autograd_node=report.autograd_node or (seen.autograd_node if seen else None),
            optimizer=report.optimizer or (seen.optimizer if seen else None),
            history=tuple(watch.history),
            warnings=tuple(watch.warnings),
            reproduced=True,
            models_watched=len(watch.targets.roots),
            ops=watch.config.ops,
            note_facts=(*report.note_facts, Note.of("step-replayed", step=step), *met),
        )
        # The cause reads the run's history (a diverging loss), which the replay did not have.
        return dataclasses.replace(report, cause=diagnose(report))

    @staticmethod
    def _not_replayed(seen: Report, why: Note) -> Report:
        # (Unseen: torch's anomaly mode stopped the backward before any check; a mode="full" watch would not see it.)
        # (Inputs written in place since the call: a mode="full" replay starts from the same written values; only
        # the op tracer, which sees the write as it runs, can name it.)
        note = Note.of("not-reproduced-unseen" if seen.unlocated else "not-reproduced-inputs"
                       if why.kind == "inputs-modified" else "not-reproduced", reason=why.pair)
        return dataclasses.replace(seen, reproduced=False, note_facts=(*seen.note_facts, note))


_dict_get: Any = dict.get


def _trainable(module: nn.Module) -> frozenset[int]:
    """The ids of ``module``'s parameters that require gradients (release_stepped waits for them).

    Each module's own ``_parameters``, not ``module.parameters()``: that walk hashes every parameter in
    Python (``Tensor.__hash__``) to drop repeats, which the set of ids does; every step of gradient
    accumulation, which no optimizer steps, learns them again (new_step).
    """
    return frozenset(id(parameter) for child in module.modules() for parameter in child._parameters.values()
                     if parameter is not None and parameter.requires_grad)
