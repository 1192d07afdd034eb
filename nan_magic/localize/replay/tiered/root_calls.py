"""A top-level model call kept for a replay of its step, and running it again (replay/tiered/step.py).

:class:`RootCall` is what tier 1 keeps of each top-level call of a watched
model; :func:`rerun` runs one again, eagerly, under a nested full watch with
op-level tracing, and returns what that replay found as an :class:`Outcome`,
which :class:`~nan_magic.localize.replay.tiered.step.StepReplays` turns into the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nan_magic.distributed.ranks import is_sharded
from nan_magic.hot.kept.buffer_copies import counted_back
from nan_magic.hot.kept.held import running_arguments
from nan_magic.hot.kept.parameter_writes import Learning
from nan_magic.hot.kept.rng import AutocastState, RngState, generators_at
from nan_magic.hot.kept.saved_hooks import saved_hooks_of
from nan_magic.hot.reads import iter_tensors, transformed_call, version_of
from nan_magic.hot.stats import tensor_stats
from nan_magic.localize.ops.reached import reached_failure
from nan_magic.localize.ops.sources import Caller, ReplayedFrom
from nan_magic.localize.replay.layer_rows import step_layers, with_layers
from nan_magic.localize.replay.line_replay import NOT_REACHED, LineStop, line_stop_for, nodes_made
from nan_magic.localize.replay.module_run import copy_tensors, parameters_at, swapped_buffers
from nan_magic.localize.replay.tiered.step_backward import ReplayWatch, reentrant_checkpoints_inline, replay_backward
from nan_magic.localize.replay.untouched import untouched
from nan_magic.options import WatchConfig
from nan_magic.patches.functional_calls import own_tensors
from nan_magic.records import Note, Phase, Report, TensorRef, TensorRole, TensorStats

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nan_magic.hot.kept.call_records import Call
    from nan_magic.hot.watched.targets import ModuleInfo

__all__ = ["NestedWatch", "Outcome", "RootCall", "replay_target", "rerun"]


@dataclass
class RootCall:
    """What one top-level call of a watched model needs to be run again."""

    module: nn.Module
    info: ModuleInfo
    args: tuple[Any, ...]
    rng: RngState
    grad_enabled: bool
    autocast: AutocastState | None
    #: ``id(buffer)`` -> its value before the call, for the buffers the call may change.
    buffers: dict[int, torch.Tensor]
    versions: list[tuple[torch.Tensor, int]]
    buffer_versions: list[tuple[torch.Tensor, int]]
    #: The buffers copied into ``buffers``, in order (a later call of the model reuses the copies: buffer_copies.py).
    buffer_sources: list[torch.Tensor] = field(default_factory=list)
    #: Ids of its BatchNorms' step counters: the call changes them, but :meth:`buffers_before` counts them back.
    counters: frozenset[int] = frozenset()
    #: The watch's record of the call.
    call: Call | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: Whether the call returned (its keyword arguments are known then: global pre-hooks never see them).
    returned: bool = False
    #: The gradient that flowed into each output, by the output's path (``output``, ``output[0]``).
    output_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    #: The deferred mode's gradients into an output that a later backward's replaced in ``output_grads``, kept until
    #: the step's check has counted them (StepKeeping.capture_gradient).
    earlier_grads: list[torch.Tensor] = field(default_factory=list)
    #: Weak references to its outputs that require grad: a backward may still reach it while one lives.
    outputs: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    #: The user's ``saved_tensors_hooks`` context the call started under (hot/kept/saved_hooks.py), or None.
    saved_hooks: Any = None
    #: ``(code, line, globals)`` of the user's line that made the call (errors/frames.user_line).
    site: tuple[CodeType, int, dict[str, Any]] | None = None
    #: ``(code, id(frame), f_lasti, f_lineno)`` of that user's frame as it made the call: a replay judged later
    #: (the deferred check at ``opt.step()``) puts the frame back at this line in the traceback (sources.Caller).
    caller: Caller | None = None
    #: Autograd nodes this thread had made when the call began, where kept (ops mode: replay/line_replay.py).
    nodes_before: int | None = None
    #: ``(parameter, its value before the call)`` for the parameters its model's forward writes in place (a max-norm
    #: renorm under no_grad, an embedding's ``max_norm``), learned at the model's first call (StepReplays.begin).
    parameters: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    #: Whether it was made inside a ``torch.func.functional_call`` of its model (on the tensors that call swapped in).
    in_functional_call: bool = False
    #: At a model's first call in a mode: what it noted to learn which parameters its forward writes.
    learning: Learning | None = None
    #: ``(input, its value before the call)`` for a model whose forward writes its own input in place
    #: (``x /= x.norm(...)``), learned from a call that moved an input's version counter (StepReplays.finish).
    inputs_before: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    #: Its module's ``training`` flag at the call: a validation call under ``eval()`` judged by the deferred check
    #: after the loop's ``model.train()`` runs again in the mode it ran in (an eval-only branch of its forward).
    training: bool = True

    def buffers_before(self) -> dict[int, torch.Tensor]:
        """``buffers``, with the step counters that changed and were not copied as they were before the call."""
        if not self.counters:
            return self.buffers
        before = dict(self.buffers)
        for buffer, version in self.buffer_versions:
            if id(buffer) in self.counters and id(buffer) not in before:
                before[id(buffer)] = counted_back(buffer, version)
        return before

    def wrote_its_state(self) -> bool:
        """Whether the call wrote in place what its module reads, and this holds it from before: a parameter (a
        max-norm renorm), a buffer copied before it (an ActNorm's 'initialised' flag, set at its first call)."""
        return bool(self.parameters) or any(
            id(buffer) in self.buffers and version_of(buffer) != version for buffer, version in self.buffer_versions)

    def awaits_backward(self) -> bool:
        """Whether a backward may still reach this call: one of its outputs with a graph is alive."""
        return any(ref() is not None for ref in self.outputs)


def replay_target(module: nn.Module) -> nn.Module | None:
    """The eager module a replay runs: ``_orig_mod`` of a compiled model, ``module`` of DDP.

    None for a model sharded by FSDP: its forward gathers parameters with
    collectives that the other ranks would have to join.
    """
    if is_sharded(module):
        return None
    unwrapped = getattr(module, "_orig_mod", module)
    if isinstance(unwrapped, nn.parallel.DistributedDataParallel):
        unwrapped = unwrapped.module
    return unwrapped


@dataclass
class Outcome:
    """What one replay found: the nested watch's report, the producer's frame, the boundary's stats."""

    report: Report | None = None
    #: The replay's first benign event, where it found no real one (a deliberate infinity).
    benign: Report | None = None
    frame: FrameType | None = None
    #: ``(f_lasti, f_lineno)`` of ``frame`` when the op ran (the replay ran on to its end).
    position: tuple[int, int] | None = None
    #: How the replay reached ``frame``: the loop's line that called the model, each forward between.
    calls: tuple[tuple[FrameType, int, int], ...] = ()
    boundary: TensorStats | None = None
    failure: BaseException | None = None
    why_not: Note | None = None
    #: What the report says of the frame %debug opens where a replay made it (replay/line_replay.py).
    debug_note: Note | None = None
    #: The user's generators the replay drew from whose state at the call was not kept (hot/kept/generators.py).
    unkept: list[torch.Generator] = field(default_factory=list)


#: Makes the nested full watch of a replay over a model (its label, the replay's config); raises
#: ValueError when the model cannot be replayed (a compiled submodule inside).
NestedWatch = Callable[[nn.Module, str | None, WatchConfig], ReplayWatch]


@contextlib.contextmanager
def training_as(module: nn.Module, training: bool) -> Iterator[None]:
    """``module`` in the mode a call ran in, its submodules' own flags put back after: the loop switched it since
    (``model.eval()`` for a validation batch, ``model.train()`` again before the check). Switched as the user switches
    it, by ``train()`` (an override that keeps its BatchNorms frozen runs); nothing done where the mode is the same.
    What such an override may also switch, its parameters' ``requires_grad`` (a backbone frozen in eval), is put back
    too: the user's model leaves the replay as it entered it."""
    if module.training == training:
        yield
        return
    flags = [(sub, sub.training) for sub in module.modules()]
    requiring = [(parameter, parameter.requires_grad) for parameter in module.parameters()]
    try:
        module.train(training)
        yield
    finally:
        for sub, flag in flags:
            sub.training = flag
        for parameter, flag in requiring:
            if parameter.requires_grad != flag:
                parameter.requires_grad_(flag)


def rerun(root: RootCall, backward: bool, boundary: TensorRef | None, model: nn.Module | None,
          config: WatchConfig, standing_aside: Callable[[], AbstractContextManager[object]],
          nested: NestedWatch, anomaly: bool = False, stop: LineStop | None = None) -> Outcome:
    """Run ``root`` again under a nested full watch with op-level tracing.

    ``model`` is the eager watched model that holds the call's module (the whole
    model is watched); ``standing_aside`` makes the outer watch ignore the replay.
    ``anomaly``: torch's anomaly mode stopped the user's backward at a node that returned NaN; where no boundary
    of the replay sees a non-finite value (a later node's backward zeroed it: relu's, where's), the first
    backward op that made one is the producer, as the live op tracer names it (op_origins.anomaly_finding).
    ``stop``: run the call's forward only, as a backward replay runs it, to the end of a line (replay/line_replay.py).
    """
    target = replay_target(root.module)
    if target is None or model is None:
        return Outcome(why_not=Note("sharded-not-replayed"))
    if transformed_call(root.args, root.kwargs):
        # A call made inside a torch.func transform (``vmap(jacrev(encoder))`` in the loss code): its arguments are
        # the transform's wrappers, which can be neither read nor copied once the transform has returned.
        return Outcome(why_not=Note("transform-not-replayed"))
    replay_config = dataclasses.replace(
        config, mode="full", ops=True, defer=False, on_detect="log",
        log_file=None, dump=None, keep_last_good=None,
    )
    # The whole model is watched, so that a submodule called at top level keeps its qualified name
    # (a compiled submodule inside runs eagerly, as the replayed model does: module_hooks.py).
    inner = nested(model, root.info.model, replay_config)
    outcome, to_line = Outcome(), None
    with contextlib.ExitStack() as stack:
        stack.enter_context(parameters_at(root.parameters))  # (outside the guard: it puts them back last)
        if not root.in_functional_call:
            # A call made before a functional_call of the model (MAML's support call), replayed inside that one (the
            # query call's event): with the model's own parameters, not the tensors the functional_call swapped in.
            stack.enter_context(own_tensors(root.module))
        guard = stack.enter_context(untouched(target))
        stack.enter_context(standing_aside())
        stack.enter_context(swapped_buffers(root.module, root.buffers_before()))
        stack.enter_context(training_as(root.module, root.training))
        for device, dtype in root.autocast or ():
            stack.enter_context(torch.autocast(device, dtype=dtype))
        stack.enter_context(saved_hooks_of(root.saved_hooks))  # (a float16 pack's inf, saved for the backward)
        stack.enter_context(torch.set_grad_enabled(root.grad_enabled or backward or stop is not None))
        if backward or stop is not None:
            stack.enter_context(reentrant_checkpoints_inline())
        if not root.returned:
            # An event judged inside the call (a per-module step): its keyword arguments are in its frame.
            running = running_arguments(root.module)
            if running is not None:
                root.kwargs = running[1]
        with torch.no_grad():
            # (An input the call wrote in place starts from its value before the call, where it was kept.)
            copies = {id(tensor): before.clone() for tensor, before in root.inputs_before}
            args, kwargs = copy_tensors(root.args, copies), copy_tensors(root.kwargs, copies)
        # An argument that required gradients still does: a frozen model's backward reaches its input
        # (an adversarial perturbation), and a reentrant checkpoint builds its graph only from one.
        inputs, input_paths = [], []  # (and where each is, ``input[0]``: a gradient only it gets is named by it)
        for path, tensor in [*(("input" + path, tensor) for path, tensor in iter_tensors(root.args)),
                             *(("kwargs" + path, tensor) for path, tensor in iter_tensors(root.kwargs))]:
            if tensor.requires_grad and id(tensor) in copies and not copies[id(tensor)].requires_grad:
                inputs.append(copies[id(tensor)].requires_grad_())
                input_paths.append(path)
        # The call's draws (dropout, its own generators'), the user's put back after.
        draws = stack.enter_context(generators_at(root.rng))
        # An op of the replay with no user frame inside the model (an nn.Linear's, a parametrization's) was
        # run by the user's line that called the model, not by the line the replay runs from (opt.step()).
        stack.enter_context(ReplayedFrom(root.site, sys._getframe(), root.caller))
        with inner:
            deliberate = _deliberate_arguments(root, copies)
            for copy in deliberate:
                inner.forward.rule.take_as_deliberate(copy)
            if inner.origins.tracer is not None:
                inner.origins.tracer.note_benign(deliberate)
                inner.origins.tracer.before_write = guard.before_write
                # A replay from a gradient hook (a per-module step's event) runs inside the user's backward:
                # its forward ops belong to that graph task, and are the replay's forward, with their lines.
                inner.origins.tracer.forward_task = torch._C._current_graph_task_id()
            returned = False  # (the forward returned: a failure after it is no user's error of the forward)
            try:
                start = nodes_made()
                if stop is not None:
                    with stop.armed():
                        target(*args, **kwargs)
                    return outcome
                output = target(*args, **kwargs)
                returned = True
                if not backward:
                    outcome.boundary = _stats_at(output, _output_path(boundary))
                else:
                    outcome.boundary = replay_backward(inner, target, root.output_grads, output, boundary, inputs,
                                                       _originals(root), input_paths)
                    tracer = inner.origins.tracer
                    started = [origin for origin in tracer.started if origin.phase == Phase.BACKWARD] if (
                        anomaly and inner.report is None and tracer is not None) else []
                    if started:
                        inner.origins.report_op(started[0])
                    if inner.producer_frame is None:
                        to_line = line_stop_for(tracer, inner.report, start)
            except Exception as error:  # the replay of a failing forward fails too, after its event
                outcome.failure = error
                tracer = inner.origins.tracer
                if inner.report is None and tracer is not None and (reached := (
                        tracer.started[0] if tracer.started else None) if returned else reached_failure(
                        tracer, error)) is not None:
                    # Stopped before the value reached a boundary: the op that made the value that reached what
                    # raised is the producer (a NaN made and discarded before the user's own error is not: reached.py).
                    inner.origins.report_op(reached)
            # The whole replayed step's table, not the calls made up to the event: read before the watch is left.
            layers = step_layers(inner.log, inner.targets.infos(), config.max_layers, per_module=True)
    outcome.report = with_layers(inner.report, layers)
    outcome.unkept = draws.unkept
    outcome.benign = with_layers(next((event for event in inner.events if event.benign), None), layers)
    outcome.frame, outcome.position, outcome.calls = inner.producer_frame, inner.producer_position, inner.producer_calls
    if outcome.report is not None and outcome.report.phase == Phase.DATA and outcome.report.op is None and any(
            version_of(tensor) != version for tensor, version in _unkept(root)):
        # The replay found the batch non-finite as it entered, but the batch was written in place since the call
        # began: by the call itself (``x /= x.norm(dim=1, keepdim=True)`` in its forward, over a blank row), as the
        # boundary check, which saw it enter finite, knows. The replay started from the values the write left, not
        # those the call received: it cannot tell the op, and the batch is not the producer.
        outcome.report = None
    if to_line is not None and outcome.report is not None:
        # A backward op named by its forward line, whose frame has returned: %debug opens a replay of that line.
        rerun(root, False, None, model, config, standing_aside, nested, stop=to_line)
        if to_line.frame is not None:
            outcome.frame, outcome.position, outcome.calls = to_line.frame, to_line.position, to_line.calls
            outcome.debug_note = Note("debug-in-replay")
        else:
            outcome.debug_note = Note.of("debug-not-replayed", reason=NOT_REACHED)
    elif outcome.frame is not None and outcome.report is not None:
        outcome.debug_note = _debug_note(outcome.frame, outcome.report)
    if outcome.report is None:
        changed = [tensor for tensor, version in _unkept(root) if version_of(tensor) != version]
        if changed:
            outcome.why_not = Note("inputs-modified")
        elif outcome.unkept:  # (it drew other numbers than the call did: generators.py)
            outcome.why_not = Note("generator-not-kept")
        elif outcome.failure is not None:
            outcome.why_not = Note.of("step-replay-raised", error=type(outcome.failure).__name__,
                                      message=str(outcome.failure))
    return outcome



def _deliberate_arguments(root: RootCall, copies: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """The replay's copies of the call's arguments whose infinities the watch judged deliberate where they were made:
    another watched model's output masked with -inf (its record, or the one the argument's record follows, benign).
    The replay sees them enter from outside; it must not call them bad data (a consumer that makes a NaN of them,
    a softmax over a fully masked row, is the producer)."""
    found: list[torch.Tensor] = []
    for _path, _argument, record, ref, _version in root.call.inputs if root.call is not None else ():
        tensor = ref()
        made = record.inner if record is not None else None
        if tensor is not None and id(tensor) in copies and record is not None and (
                record.status == "benign" or (made is not None and made.status == "benign"
                                              and record.kinds <= made.kinds)):  # (no NaN made of it since)
            found.append(copies[id(tensor)])
    return found


def _unkept(root: RootCall) -> list[tuple[torch.Tensor, int]]:
    """The call's input tensors and versions, less those whose value before the call was kept (replayed from it)."""
    kept = {id(tensor) for tensor, _before in root.inputs_before}
    return [(tensor, version) for tensor, version in root.versions if id(tensor) not in kept]


def _output_path(boundary: TensorRef | None) -> str | None:
    """Where in the model's output the boundary is; None for a boundary that is not a model output."""
    return boundary.path if boundary is not None and boundary.role is TensorRole.MODULE_OUTPUT else None


def _stats_at(output: Any, path: str | None) -> TensorStats | None:
    for tensor_path, tensor in iter_tensors(output, "output", attributes=True):
        if tensor_path == path:
            return tensor_stats(tensor)
    return None


def _originals(root: RootCall) -> dict[str, torch.Tensor]:
    """The call's outputs that are still alive, by path (a user's gradient hook on one runs in the replay too)."""
    if root.call is None:
        return {}
    alive = ((str(record.path), record.ref()) for record in root.call.outputs)
    return {path: tensor for path, tensor in alive if tensor is not None}


def _debug_note(frame: FrameType, report: Report) -> Note:
    """What the report says of the frame %debug opens: a replay's, at the report's line; or, where the line ran in a
    function that had returned before the step was judged (a helper that called the model, ``loss_of(model)``,
    judged at ``opt.step()`` by the deferred check), the loop's frame that runs the check, and why.

    A replay of a model call runs the model's code only: where that is all torch's (a parametrization, a library
    layer), the user frame of its ops is the frame that runs the replay, not one at the report's line.
    """
    source = report.source
    running: FrameType | None = sys._getframe(1)
    while running is not None and running is not frame:
        running = running.f_back
    if source is None or running is None or (frame.f_lineno, frame.f_code.co_filename) == (source.lineno,
                                                                                        source.filename):
        return Note("debug-in-replay")  # the op's frame is this replay's, its locals the replay's
    ancestor: FrameType | None = frame
    while ancestor is not None and not (ancestor.f_code.co_filename == source.filename
                                        and ancestor.f_code.co_name == source.function):
        ancestor = ancestor.f_back
    if ancestor is not None:
        return Note("debug-in-replay")
    return Note.of("debug-frame-returned", function=source.function, line=source.lineno)

