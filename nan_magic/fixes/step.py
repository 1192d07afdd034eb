"""One replay of the failing step on copies, with or without a remedy: forward, backward, optimizer step.

The copies: the called module's parameters (run with ``torch.func.functional_call``, so no module object is
copied and the watch's hooks on the originals are not walked), its buffers as the failing call found them
(``swapped_buffers``), the optimizers that step those parameters (rebuilt on the copies, their state loaded), the
call's arguments; the call's generators are restored around it and the user's put back (``generators_at``), and
the modules' Python state too (``untouched``). Nothing of the user's is written: no ``.grad``, no optimizer state,
no BatchNorm statistics, no draw from their generators.

The loss: the recorded loss code run again on the replayed outputs (loss.py), which may start from the model's own
scalar loss (a Hugging Face model given its labels: ``out.loss / accumulation``); where no loss code could run,
that scalar itself; a non-finite loss fails the step there. The backward starts from that loss; without one, from
what the step held: the gradient that flowed into the outputs (a backward event; a finite one, see
held_gradients), else a gradient of ones into each floating output, standing for the loss.

Under a GradScaler the backward of the step ran at its scale:
``FailingStep.grad_scale`` is ``(the scale to replay at, the scale the held
output gradient carries)``. The gradient the backward starts from is scaled
to the first (fixes/remedies/scale.py tries lower ones), and the parameters'
gradients are divided by it before the optimizer step, as ``scaler.step``
unscales them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nan_magic.fix_records import FailedAt
from nan_magic.fixes.deliberate import deliberate_outputs, held_remedy, holds_only_infinities
from nan_magic.fixes.deliberate import floating_outputs as _floating
from nan_magic.fixes.loss import LossCode, LossNotComputed
from nan_magic.fixes.probe import gradient_sums
from nan_magic.fixes.site import REPLAY_CALLERS, InRecordedCode, Remedy, Site, at_producer, in_backward_nodes
from nan_magic.fixes.stepping import step_alone
from nan_magic.hot.kept.rng import generators_at
from nan_magic.hot.kept.saved_hooks import saved_hooks_of
from nan_magic.hot.reads import iter_tensors, values_to_read
from nan_magic.localize.ops.plans import plan_of, tensors
from nan_magic.localize.replay.module_run import copy_tensors, swapped_buffers
from nan_magic.localize.replay.tiered.root_calls import RootCall, training_as
from nan_magic.localize.replay.tiered.step_backward import reentrant_checkpoints_inline
from nan_magic.localize.replay.untouched import ModelGuard, untouched
from nan_magic.note_records import Note
from nan_magic.patches.functional_calls import own_tensors

__all__ = ["FailingStep", "StepOutcome", "held_gradients", "replay_at_line", "replay_step"]


@dataclass
class FailingStep:
    """What a fix trial replays: the failing model call, its eager model and module, the optimizers."""

    root: RootCall
    #: The eager watched model that holds the call's module (root_calls.replay_target), and that module.
    model: nn.Module
    target: nn.Module
    optimizers: tuple[torch.optim.Optimizer, ...]
    #: The watch's hooks ignore what the trial runs (call_replay.standing_aside).
    standing_aside: Callable[[], contextlib.AbstractContextManager[None]]
    #: (the GradScaler scale the backward replays at, the scale the held output gradient carries).
    grad_scale: tuple[float, float] = (1.0, 1.0)
    #: The parameters the replay starts from by name (fixes/remedies/diverged.py), instead of the module's own.
    parameters: dict[str, torch.Tensor] | None = None
    #: The recorded loss code (loss.py), or why there is none.
    loss_code: LossCode | Note | None = None
    #: The event stopped the step before its loss code ran (a forward or data event judged as it happened): what a
    #: trial without a loss says first, the rest of why being in ``loss_code``.
    before_loss_code: bool = False
    #: The samples of the batch the replay keeps (skip-batch): the loss code's targets keep the same rows.
    rows: torch.Tensor | None = None
    #: The GradScalers the watch saw (the ``scale`` fix's edit is at the line that built one).
    scalers: tuple[Any, ...] = ()


@dataclass
class StepOutcome:
    """What one replay of the step gave."""

    #: The model's floating outputs by path, detached.
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: float | None = None
    #: Where the step first went non-finite, or ``"raised"``; None for a step finite end to end.
    failed: FailedAt | None = None
    #: What it raised: the exception's type name and its message's first line.
    error: tuple[str, str] | None = None
    #: Calls the remedy changed (0: it found nothing to change at the producer).
    applied: int = 0
    seconds: float = 0.0
    #: Whether an optimizer step was replayed (no optimizer of the model was seen stepping).
    stepped: bool = False
    #: Where the loss came from (``"model"``, ``"loss code"``, ``"last loss code"``), or why none was computed.
    loss_from: str | None = None
    no_loss: Note | None = None
    #: Why the loss code did not run where the model's own scalar output stood for the loss (``loss_from="model"``).
    stand_in: Note | None = None
    #: Whether outputs were let through for deliberate infinities (deliberate.py): a loss must judge them.
    deliberate: bool = False
    #: The sum of each trained parameter's gradient's magnitudes (None: it got none), where the backward ran.
    gradients: tuple[float | None, ...] = ()
    #: The machine eps of the coarsest of those gradients' dtypes (float16's: a scaled exp's backward rounds there).
    gradient_eps: float = 0.0
    #: The trained parameters that were an operand the remedy moved whole and got no gradient at all: it froze
    #: them (a clamp of ``sqrt(scale)`` at ``scale = 0``: ``scale`` would never leave 0).
    frozen: tuple[str, ...] = ()
    #: Each trained parameter's gradient by its id (the frozen rule reads those elements a remedy moved).
    grads: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False, compare=False)
    #: The called module's floating buffers by name as the failing call's forward left them (a running statistic
    #: it wrote): a remedy that moves one changes what the model keeps, though its outputs stay (changes_value).
    buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)


def replay_at_line(step: FailingStep, site: Site, remedy: Remedy) -> tuple[StepOutcome, Remedy, bool]:
    """``remedy`` at ``site`` (:func:`replay_step`); where the step stays non-finite and the producer's line runs in
    other modules too, the line remedied in every module that runs it: ``(outcome, the remedy that ran, whether
    in every module)``.

    The trial remedies the producing module alone (its output_change is that module's), but an edit of the line
    changes every module that runs it: a helper each attention layer calls, a block repeated. Where the other
    modules' calls of the line go non-finite too, the producing module's trial fails though the edit, by hand,
    trains on: the edit's own trial is the one to report. A remedy object without ``renewed`` is not tried again.
    """
    outcome = replay_step(step, site, remedy)
    fresh = getattr(remedy, "renewed", None)
    if outcome.failed is None or not outcome.applied or not site.module or (
            fresh is None and not inspect.isfunction(remedy)) or _in_loss_code(step, site):
        return outcome, remedy, False
    again = fresh() if fresh is not None else remedy
    wider = replay_step(step, dataclasses.replace(site, module=""), again)
    if wider.applied <= outcome.applied:  # the line runs in the producing module alone
        return outcome, remedy, False
    wider.seconds += outcome.seconds
    return wider, again, True


def _in_loss_code(step: FailingStep, site: Site) -> bool:
    """Whether the producer's function ran at its line in the step's recorded loss code too (a helper's ``t.exp()``
    for a learned temperature; not a teacher's Linear on a line whose ``.float()`` it ran): the wider trial changes the
    models' calls alone, not the loss code as the edit of the line would; the producing module's trial is reported."""
    code, source = step.loss_code, site.source
    return isinstance(code, LossCode) and source is not None and any(
        op.code is not None and op.lineno == source.lineno and op.code.co_filename == source.filename
        and site.function in (None, getattr(getattr(op.func, "overloadpacket", op.func), "__name__", None))
        for op in code.ops)


def replay_step(step: FailingStep, site: Site | None, remedy: Remedy | None) -> StepOutcome:
    """Replay ``step`` on copies, with ``remedy`` applied at ``site`` (None: as the user's code ran)."""
    start = time.perf_counter()
    outcome = StepOutcome()
    root = step.root
    with contextlib.ExitStack() as stack:
        if not root.in_functional_call:
            # A call made before a functional_call of the model (MAML's support call), its trial run inside that
            # one (the query call's event): with the model's own parameters, as the step replay runs it
            # (root_calls.py), not the tensors the functional_call swapped in (NaN: made by the failing backward).
            stack.enter_context(own_tensors(root.module))
        stack.enter_context(step.standing_aside())
        guard = stack.enter_context(untouched(step.target))
        if any(isinstance(module, torch._dynamo.eval_frame.OptimizedModule) for module in step.model.modules()):
            stack.enter_context(torch.compiler.set_stance("force_eager"))  # a compiled submodule runs eagerly
        with torch.no_grad():
            given = step.parameters or {}
            before = {id(parameter): value for parameter, value in root.parameters}  # (ones the forward writes)
            parameters = {name: given.get(name, before.get(id(parameter), parameter)).detach().clone()
                          .requires_grad_(parameter.requires_grad)
                          for name, parameter in step.target.named_parameters()}
        arguments = _arguments(root)
        # ... and a reentrant block runs inline, with its graph: its form refuses torch.autograd.grad.
        stack.enter_context(reentrant_checkpoints_inline())
        originals = dict(step.target.named_parameters())
        copies = {id(originals[name]): copy for name, copy in parameters.items()}  # (by the original's id)
        optimizers = _optimizers(step.optimizers, copies)
        mode = in_loss = None
        if remedy is not None and site is not None and site.module is None:
            in_loss = InRecordedCode(site, remedy)  # a producer in the loss code: remedied as that code runs again
        elif remedy is not None and site is not None:
            mode, remove = at_producer(step.model, site, remedy)
            stack.callback(remove)
        writes = _GuardWrites(guard)
        try:
            # The step's other calls whose outputs the loss code reads, each from its own buffers and generators.
            others = [_call_forward(step.target, parameters, call, mode, writes) for call in _other_calls(step)]
            output = _call_forward(step.target, parameters, root, mode, writes, stack, arguments)
            with torch.no_grad():  # (the replay's own copies, swapped in: cloned, as the next forward writes them)
                outcome.buffers = {name: buffer.detach().clone() for name, buffer in root.module.named_buffers()
                                   if buffer.is_floating_point()}
            if mode is not None and site is not None and site.in_backward:
                stack.callback(in_backward_nodes(mode, site.in_backward, [t for _, t in _floating(output)]))
            deliberate = _deliberate(output, lambda: _call_forward(
                step.target, parameters, root, mode, writes, arguments=_arguments(root)), remedy, mode)
            _judge(outcome, output, step, copies, optimizers, in_loss, others, deliberate, arguments)
            frozen = getattr(remedy, "frozen", None)
            outcome.frozen = frozen(parameters, outcome.grads) if callable(frozen) and outcome.grads else ()
            if outcome.failed is None and outcome.stepped and remedy is not None and _next_forward_fails(
                    step.target, parameters, root, mode, writes, remedy):
                outcome.failed = "next forward"
        except Exception as error:  # a remedy that breaks the code (a float32 operand meeting a half weight)
            outcome.failed = "raised"
            outcome.error = (type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        remedied = in_loss or mode
        if remedied is not None:
            outcome.applied = remedied.applied
    outcome.seconds = time.perf_counter() - start
    return outcome


def _next_forward_fails(target: nn.Module, parameters: dict[str, torch.Tensor], root: RootCall, mode: Any,
                        writes: _GuardWrites, remedy: Remedy) -> bool:
    """Whether the failing call, run once more on the updated copies with the remedy in place (as the edit leaves
    it), goes non-finite: a clamp that makes the step finite may make its gradient huge (d/dl of
    ``y / l.clamp_min(1e-7)`` is 1e7 at l = 0), and its update overflow the next forward, where by hand the run
    fails a step later. What the remedy counted (the values it moved, the calls it changed) stays the step's; a
    forward that raises says nothing against the step, nor does a deliberate infinity (deliberate.py)."""
    def again() -> Any:
        return _call_forward(target, parameters, root, mode, writes, arguments=_arguments(root))
    with held_remedy(remedy, mode):
        try:
            output = again()
            bad = [path for path, tensor in _floating(output) if not _finite(tensor)]
            return bool(bad) and not (holds_only_infinities(output) and set(bad) <= deliberate_outputs(again))
        except Exception:  # (the step's verdict stands: this forward is only a check of its update)
            return False


def _deliberate(output: Any, again: Callable[[], Any], remedy: Remedy | None, mode: Any) -> frozenset[str]:
    """The outputs whose infinities are all deliberate (deliberate.py), of a remedied replay only: the unremedied one
    reproduces the event as the watch judged it (the tracer alone takes a ``log`` of a 0/1 batch for a mask's)."""
    if remedy is None or not holds_only_infinities(output):
        return frozenset()
    with held_remedy(remedy, mode):
        try:
            return deliberate_outputs(again)
        except Exception:  # (a check that cannot run leaves the strict rule, not a raised trial)
            return frozenset()


def _other_calls(step: FailingStep) -> tuple[RootCall, ...]:
    """The step's other calls of the module whose outputs the loss code reads (loss.py), where the trial keeps the
    whole batch (skip-batch's smaller one is given to the failing call alone)."""
    code = step.loss_code
    return code.others if isinstance(code, LossCode) and step.rows is None else ()


def _arguments(call: RootCall) -> tuple[Any, Any]:
    """Copies of ``call``'s arguments for a trial: ``(args, kwargs)``."""
    with torch.no_grad():
        # An input the call wrote in place (``x /= x.norm(...)`` in its forward) starts from its value before the
        # call, as the step replay's does (root_calls.py): else the trial runs on what the failing call left in it
        # (its NaN) and no remedy can come out finite.
        copies = {id(tensor): before.clone() for tensor, before in call.inputs_before}
        args, kwargs = copy_tensors(call.args, copies), copy_tensors(call.kwargs, copies)
    # An argument that required gradients still does: a reentrant checkpoint builds its graph only from one, and
    # without it the trial's backward skipped the block (its parameters got no gradient, which read as a finite
    # one: a "verified" remedy whose backward, by hand, is NaN).
    for _path, tensor in [*iter_tensors(call.args), *iter_tensors(call.kwargs)]:
        if tensor.requires_grad and id(tensor) in copies and not copies[id(tensor)].requires_grad:
            copies[id(tensor)].requires_grad_()
    return args, kwargs


def _call_forward(target: nn.Module, parameters: dict[str, torch.Tensor], call: RootCall, mode: Any,
                  writes: _GuardWrites, stack: contextlib.ExitStack | None = None,
                  arguments: tuple[Any, Any] | None = None) -> Any:
    """``call``'s forward on the copies, from its buffers as it found them and its generators as it began.

    ``stack``: its buffers and generators stay in it for the rest of the step (the failing call); None: they are
    put back as it returns (another call of the step). ``arguments``: copies made already (:func:`_arguments`).
    """
    with contextlib.ExitStack() as own:
        where = own if stack is None else stack
        where.enter_context(swapped_buffers(call.module, call.buffers_before()))
        where.enter_context(training_as(call.module, call.training))  # (in the mode it ran in, as the replay)
        args, kwargs = arguments if arguments is not None else _arguments(call)
        where.enter_context(generators_at(call.rng))
        return _forward(target, parameters, args, kwargs, call, mode, writes)


def _optimizers(optimizers: tuple[torch.optim.Optimizer, ...], copies: dict[int, torch.Tensor]
                ) -> list[torch.optim.Optimizer]:
    """The optimizers that step only the called module's parameters, rebuilt on the copies with their state.

    An optimizer that also steps other parameters, or whose class cannot be
    built from its parameter groups alone, is left out (its step is not replayed).
    """
    rebuilt = []
    for optimizer in optimizers:
        groups = [{**group, "params": [copies.get(id(parameter)) for parameter in group["params"]]}
                  for group in optimizer.param_groups]
        if any(parameter is None for group in groups for parameter in group["params"]):
            continue
        try:
            rebuilt_one = type(optimizer)(groups)  # type: ignore[call-arg]  # its defaults are in the groups
            # load_state_dict keeps the very tensors it is given (``.to`` of the same dtype and device): copies.
            rebuilt_one.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        except (TypeError, ValueError, KeyError):
            continue
        rebuilt.append(rebuilt_one)
    return rebuilt


class _GuardWrites(TorchDispatchMode):
    """Saves what the forward writes in place of the module's own tensors (a running count) before it does."""

    def __init__(self, guard: ModelGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload):
            plan = plan_of(func)
            if plan.writes:
                for _name, tensor in tensors(plan, args, kwargs, plan.writes):
                    self.guard.before_write(tensor)
        return func(*args, **kwargs)


def _forward(target: nn.Module, parameters: dict[str, torch.Tensor], args: Any, kwargs: Any, root: RootCall,
             mode: Any, writes: _GuardWrites) -> Any:
    with contextlib.ExitStack() as stack:
        stack.enter_context(writes)
        for device, dtype in root.autocast or ():
            stack.enter_context(torch.autocast(device, dtype=dtype))
        stack.enter_context(saved_hooks_of(root.saved_hooks))  # (packed as the call packed: a float16 pack's inf)
        stack.enter_context(torch.enable_grad())
        if mode is not None:
            stack.enter_context(mode)
        return torch.func.functional_call(target, parameters, tuple(args), kwargs)


REPLAY_CALLERS.add(_forward.__code__)


def forward_only(step: FailingStep) -> bool:
    """Whether a trial replays the call's forward alone: it ran under no_grad and no loss code of its step was kept.

    A validation batch has no loss, backward or update: a backward from ones and an optimizer step standing in for
    them could fail where the user's step never goes. A call under no_grad whose step goes on to a loss (a
    distillation teacher, a DQN target network) is judged by that loss where its code was kept: a remedy that makes
    the teacher's output finite may leave the loss that reads it inf.
    """
    code = step.loss_code
    # (The last step's loss code, kept with keep_last_good, read the training call's outputs, not this call's.)
    return not step.root.grad_enabled and not (isinstance(code, LossCode) and not code.last)


def _judge(outcome: StepOutcome, output: Any, step: FailingStep, copies: dict[int, torch.Tensor],
           optimizers: list[torch.optim.Optimizer], in_loss: InRecordedCode | None = None,
           others: list[Any] | None = None, deliberate: frozenset[str] = frozenset(), arguments: Any = ()) -> None:
    tensors = _floating(output)
    outcome.outputs = {path: values_to_read(tensor) for path, tensor in tensors}
    other_tensors = [dict(_floating(other)) for other in others or ()]
    judged = [tensor for path, tensor in outcome.outputs.items() if path not in deliberate]  # (deliberate.py)
    outcome.deliberate = bool(deliberate)
    if not all(_finite(tensor) for tensor in [*judged, *(t for other in other_tensors for t in other.values())]):
        outcome.failed = "forward"
        return
    if forward_only(step):
        return
    loss = _loss(outcome, tensors, step, in_loss, other_tensors if others else None, copies)
    if loss is not None and not step.root.grad_enabled and not _reads(loss, [tensor for _path, tensor in tensors]):
        # The kept loss code's loss does not read this no_grad call (a validation batch's metric recorded beside the
        # next training step's loss): the call's forward alone is what the trial proved (trial_facts: "no-grad").
        outcome.loss = outcome.loss_from = outcome.no_loss = outcome.stand_in = None
        return
    if loss is not None and not _finite(loss):
        outcome.failed = "loss"
        return
    if not step.root.grad_enabled:
        # A call under no_grad (a distillation teacher, a target network, SimSiam's stop-gradient branch) judged by
        # its step's loss: the user's backward never runs through it (a float16 teacher's backward could fail where
        # the step never goes), but it does run through the step's other calls, the same module's with grad too
        # (trial_facts: "no-grad-loss"). So the loss is taken again on the call's outputs detached.
        tensors = [(path, tensor.detach()) for path, tensor in tensors]
        loss = _loss(outcome, tensors, step, in_loss, other_tensors if others else None, copies)
    scale, carried = step.grad_scale
    begins = _backward_starts(tensors, step.root, loss)
    starts = [(tensor, grad * (scale / carried if start == "held" else scale)) for tensor, grad, start in begins]
    parameters = [parameter for parameter in copies.values() if parameter.requires_grad]
    if not starts or not parameters:
        return
    ones = all(start == "ones" for *_values, start in begins)
    # The call's arguments that require gradients get theirs too, as the user's backward gives them: a PINN's
    # derivative by its input (autograd.grad(u, x)) goes non-finite where no parameter's gradient does.
    inputs = [tensor for _path, tensor in iter_tensors(arguments) if tensor.requires_grad]
    grads = torch.autograd.grad([tensor for tensor, _grad in starts], [*parameters, *inputs],
                                grad_outputs=[grad for _tensor, grad in starts], allow_unused=True, retain_graph=ones)
    grads, input_grads = grads[:len(parameters)], grads[len(parameters):]
    if not all(grad is None or _finite(grad) for grad in (*grads, *input_grads)):
        outcome.failed = "backward"
        return
    # (each parameter's gradient, summed: remedies/stable.py's check of a rewrite compares them, where a float16
    # loss rounds a changed term away)
    outcome.gradients = gradient_sums(grads, [tensor for tensor, _grad in starts], parameters, ones)
    outcome.grads = {id(parameter): grad for parameter, grad in zip(parameters, grads)}
    outcome.gradient_eps = max((torch.finfo(grad.dtype).eps for grad in grads if grad is not None), default=0.0)
    if not optimizers:
        return
    for parameter, grad in zip(parameters, grads):
        parameter.grad = None if grad is None else grad / scale
    for optimizer in optimizers:
        try:
            step_alone(optimizer)
        except TypeError as error:
            if "closure" not in str(error):
                raise
            # LBFGS's step re-evaluates a closure the trial does not have: the step is judged without its
            # update, and says no optimizer step was replayed (stepped stays False).
            return
    outcome.stepped = True
    state = [value for optimizer in optimizers for entry in optimizer.state.values() for value in entry.values()
             if isinstance(value, torch.Tensor) and value.is_floating_point()]
    if not all(_finite(tensor) for tensor in [*parameters, *state]):
        outcome.failed = "optimizer step"


def _loss(outcome: StepOutcome, tensors: list[tuple[str, torch.Tensor]], step: FailingStep,
          in_loss: InRecordedCode | None = None, others: list[dict[str, torch.Tensor]] | None = None,
          copies: dict[int, torch.Tensor] | None = None) -> torch.Tensor | None:
    """The step's loss (see the module docstring), its value and origin noted in ``outcome``; None: not computed.
    ``in_loss``: a remedy at the loss code's producer, applied as that code runs again; ``copies``: the replay's
    parameters by their original's id, which the loss code reads in their place (LossCode.run)."""
    losses = [tensor for _path, tensor in tensors if tensor.dim() == 0]
    loss = None
    if isinstance(step.loss_code, LossCode):
        # First: the loss code may go on from the model's own loss (``out.loss / accumulation``, a log of it).
        try:
            loss = step.loss_code.run(dict(tensors), step.rows, in_loss, others, copies)
            outcome.loss_from = "last loss code" if step.loss_code.last else "loss code"
        except LossNotComputed as error:
            outcome.no_loss = error.reason
    else:
        outcome.no_loss = step.loss_code
    if loss is None and len(losses) == 1:
        # (Why the loss code did not run is kept: the model's scalar may be a term of the loss, not the loss.)
        outcome.stand_in = outcome.no_loss
        loss, outcome.loss_from, outcome.no_loss = losses[0], "model", None
    if loss is not None:
        outcome.loss = float(values_to_read(loss).detach())
    return loss


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, read through a subclass's data (a subclass may refuse reductions)."""
    return bool(torch.isfinite(values_to_read(tensor)).all())


def _reads(loss: torch.Tensor, outputs: list[torch.Tensor]) -> bool:
    """Whether ``loss`` was computed from any of ``outputs`` (its autograd graph reaches theirs); an output without
    a graph of its own cannot be told apart: it is taken as read."""
    nodes = {output.grad_fn for output in outputs if output.grad_fn is not None}
    if len(nodes) < len(outputs):
        return True
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if node in nodes:
            return True
        seen.add(node)
        stack.extend(next_node for next_node, _index in node.next_functions)
    return False


def _backward_starts(tensors: list[tuple[str, torch.Tensor]], root: RootCall, loss: torch.Tensor | None
                     ) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """``(output, gradient, "loss" | "held" | "ones")`` the backward starts from (see the module docstring)."""
    if loss is not None:
        return [(loss, torch.ones_like(loss), "loss")] if loss.requires_grad else []
    held = held_gradients(root)
    if held:
        return [(tensor, held[path].to(tensor.dtype), "held") for path, tensor in tensors
                if path in held and tensor.requires_grad]
    return [(tensor, torch.ones_like(tensor), "ones") for _path, tensor in tensors if tensor.requires_grad]


def held_gradients(root: RootCall) -> dict[str, torch.Tensor]:
    """The gradients that flowed into the call's outputs, where all are finite (else none).

    A non-finite one is the backward of a loss computed from a non-finite
    forward (the deferred check runs after it): a remedied forward's
    backward does not start from it, but from the loss or ones, as where
    the forward event stopped the step before its backward.
    """
    held = root.output_grads
    return held if all(_finite(grad) for grad in held.values()) else {}
