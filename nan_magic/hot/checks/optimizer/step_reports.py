"""What a non-finite read at an optimizer step is reported as: the cold side of step_checks.py.

The optimizer checks read one norm per step (step_checks.py); only when one is
non-finite do they come here, to measure the gradients again one by one and
name the first non-finite, or to name the parameter or state a step made
non-finite, the module that owns it, and the op of the step that made it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from types import CodeType, FrameType

import torch

from nan_magic.distributed.ranks import parameter_place
from nan_magic.errors.frames import pointer_at, user_line
from nan_magic.hot.checks.hosts import OptimizerHost, OriginFinder
from nan_magic.hot.checks.optimizer.headroom import Headroom
from nan_magic.hot.checks.optimizer.lr_schedulers import scheduler_note
from nan_magic.hot.checks.optimizer.step_layout import StepResult, default_eps, group_eps
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.reads import norms, read_scalars, relevant_kinds
from nan_magic.hot.stats import kinds_of
from nan_magic.plain import to_pairs
from nan_magic.records import Note, Phase, SourcePointer, TensorRef, TensorRole

__all__ = ["ReplayStep", "StepReports", "held_state", "read_step_result"]

#: The notes of a replay of the step (localize/replay/optimizer.py), which say whose gradient it applied.
_REPLAY_NOTES = frozenset({"optimizer-replayed", "optimizer-replay-finite"})

#: Names the op of an optimizer step that made a parameter (or its state ``key``) non-finite, given the user's
#: line that called the step (None: the line calling it now); localize/replay/optimizer.py.
#: The last argument is a copy of the parameter taken before the step, where one was (headroom.py).
ReplayStep = Callable[
    [Finding, torch.optim.Optimizer, torch.Tensor, str | None, SourcePointer | None, torch.Tensor | None], None]


class StepReports:
    """The findings of one watch's optimizer checks.

    ``origins`` (the watch's :class:`OpOrigins`) names the op that started a
    non-finite gradient or parameter;
    ``replay_step`` (where no op tracer watches the steps) the op of a step
    that made a parameter or its state non-finite.
    """

    def __init__(self, watch: OptimizerHost, origins: OriginFinder, replay_step: ReplayStep | None) -> None:
        self.watch = watch
        self._add_op_origin = origins.add_op_origin
        self._add_lr_origin = origins.add_lr_origin
        self._birth_order = origins.birth_order
        self._replay_step = replay_step
        #: Notes the half-precision parameters near their limit of each step result judged finite.
        self.headroom: Headroom | None = None

    def gradients(self, opt: torch.optim.Optimizer, with_grad: list[tuple[str, torch.Tensor]]) -> bool:
        """A gradient norm read non-finite: report the first non-finite of ``with_grad``; True when one was.

        The cold path: each gradient is measured again, by name. Every
        element finite while a norm overflowed is a warning, not an event
        (our own read overflowed). Of several non-finite gradients, the one
        whose op the op tracer saw start first (ops mode: backward computes
        the last layer's first; of one op's, its module's own), else the first in the optimizer's order.
        """
        watch = self.watch
        values = read_scalars(norms([grad for _name, grad in with_grad]))
        bad = [(name, grad) for (name, grad), value in zip(with_grad, values)
               if not math.isfinite(value) and relevant_kinds(kinds_of(grad), watch.config.kinds)]
        if bad:
            name, grad = min(bad, key=lambda item: self._birth_order(item[1], item[0])) if len(bad) > 1 else bad[0]
            finding = Finding(Phase.BACKWARD, None, TensorRef.gradient(name), bad=grad.detach())
            finding.notes.append(Note.of("about-to-step", optimizer=type(opt).__name__))
            finding.optimizer = type(opt).__name__
            self.attribute(finding)
            self._add_op_origin(finding, grad)
            watch.emit(finding)
            return True
        overflowed = [name for (name, _grad), value in zip(with_grad, values) if not math.isfinite(value)]
        cycle = watch.cycle
        cycle.warn(cycle.early.observe_norm_overflow(cycle.step, type(opt).__name__, overflowed))
        return False

    def step_result(self, result: StepResult, values: list[float], next_check: bool = False, left: bool = False,
                    stepping: object = None) -> bool:
        """Report what the step made non-finite; True when it did.

        ``next_check``: the result is read at the next step's check (the deferred mode's one transfer): the loop's
        frame has run on into that step, and the report says so of the frame ``%debug`` opens (its locals).
        ``left``: read as the watch is left (a carried result of the loop's last step): ``%debug`` opens at the line
        that called the step, in its frame where that is a cell's or script's top level (held by step_checks) or
        still runs.
        ``stepping``: the optimizer whose ``step()`` runs the next step's check (a GAN's other one).
        """
        finite = all(map(math.isfinite, values))  # (the usual step: no Python per tensor)
        for index, (tensor, value) in enumerate(() if finite else zip(result.updated, values)):
            if math.isfinite(value) or not relevant_kinds(kinds_of(tensor), self.watch.config.kinds):
                continue
            label = result.label(index)
            # A bounded step cannot make a finite parameter non-finite (step_layout.py): code outside the
            # optimizer wrote it (a hand edit, a loaded checkpoint), a value no watched code produced.
            phase = Phase.DATA if result.bounded else Phase.OPTIMIZER
            # Nor finite state non-finite: a non-finite state tensor of the parameter held its value before the
            # step (a resumed optimizer's loaded state), and the step carried it into the parameter. (Read at an
            # event only: a parameter's state, one tensor at a time.)
            held = held_state(result.optimizer, result.owner(index)[0]) if index < len(result.layout.named) else None
            finding = Finding(phase, None, label, bad=tensor.detach(), step=result.step)
            if held is not None and result.bounded:
                _blame_state(finding, label, held)
            self.attribute(finding, result.owner(index)[0])
            lr, raw_lr = result.lr_of(tensor)
            # A non-finite rate the loop computed (``group["lr"] = size.item()``, size 0 / 0): its op, not the step's.
            # Else, no op made it (computed in Python, or a tensor rate made earlier): the loop's line that set it.
            named = (phase == Phase.OPTIMIZER and lr is not None and not math.isfinite(lr)
                     and self._add_lr_origin(finding, lr, raw_lr))
            if not named and phase == Phase.OPTIMIZER and lr is not None and not math.isfinite(lr) and (
                    scheduled := scheduler_note(result.optimizer, lr)) is not None:
                finding.notes.append(scheduled)  # (no line of the loop set it: a scheduler's step did)
            if not named:
                self._add_op_origin(finding, tensor)
            if not named and finding.op is None and phase == Phase.OPTIMIZER and self._replay_step is not None:
                parameter, key = result.owner(index)
                # (Read at once, the step's post-hook runs under the loop's ``opt.step()``: the user's line is that.)
                where = result.caller if result.caller is not None else user_line(sys._getframe())
                caller = pointer_at(*where) if where is not None else None
                self._replay_step(finding, result.optimizer, parameter, key, caller, result.before.get(id(parameter)))
            if finding.op is None and held is not None and not result.bounded:
                # Any other step: no op of it made the value from finite ones (ops=True traced it; the replay from
                # finite stand-ins of the state stayed finite, replay/optimizer.py): the state held it.
                _blame_state(finding, label, held)
            subject = to_pairs(finding.tensor)  # a parameter, or a state tensor of one
            optimizer = type(result.optimizer).__name__
            finding.optimizer = optimizer
            finding.optimizer_eps = group_eps(result.optimizer, tensor)
            finding.optimizer_default_eps = default_eps(type(result.optimizer))
            finding.optimizer_lr = lr
            if finding.tensor.role is TensorRole.OPTIMIZER_STATE and label.role is TensorRole.PARAMETER:
                finding.notes.append(Note.of("state-already-nonfinite", tensor=subject, optimizer=optimizer,
                                             step=result.step, parameter=to_pairs(label), bounded=result.bounded))
            elif result.bounded:
                finding.notes.append(Note.of("written-outside-optimizer", tensor=subject, optimizer=optimizer,
                                             step=result.step, previous_check=result.previous_check))
            else:
                finding.notes.append(Note.of("optimizer-made-it", optimizer=optimizer, tensor=subject))
            if next_check and (judged := self.watch.cycle.step) != result.step:
                # The step's gradient is gone too (replaced by that step's backward): a replay applied that one.
                finding.notes[:] = [note.adding(step=result.step, gradient_step=judged)
                                    if note.kind in _REPLAY_NOTES else note for note in finding.notes]
                finding.notes.append(Note.of("debug-later-step", step=result.step, judged=judged))
            called = result.caller if left or next_check else None
            frame = None if called is None else result.caller_frame or _running(called[0])
            if next_check and stepping is not result.optimizer and frame is not None and called is not None and (
                    frame.f_lineno == called[1]):
                # At the same line, the check runs in the step() call of another optimizer (a GAN's ``update(opt,
                # loss)`` helper, called for D then G; a loop over the optimizers): its locals are that call's.
                finding.notes[:] = [note.adding(other_call=True) if note.kind == "debug-later-step" else note
                                    for note in finding.notes]
            if finding.frame is None and called is not None and frame is not None:
                # %debug opens at the line that called the step, as where it is judged at once: in the cell's or
                # script's frame that returned (the watch is left), or in the one still running (the watch is left
                # in it, or the next step runs there: the check ran at another line, a second optimizer's step, and
                # the note says its locals are that step's).
                finding.frame, finding.frame_position = frame, (result.caller_lasti, called[1])
            elif finding.frame is None and called is not None and left:
                # The function that called the step (a ``train(model)`` helper's loop) returned before the watch
                # was left: %debug opens where the watch was left, and says why not at the step's line.
                finding.notes.append(Note.of("debug-frame-returned", function=called[0].co_name, line=called[1]))
            self.watch.emit(finding)
            return True
        if self.headroom is not None:
            self.headroom.observe(result, values)
        return False

    def attribute(self, finding: Finding, parameter: torch.Tensor | None = None) -> None:
        """Name the module that owns the parameter in ``finding.tensor``.

        By the watch's names (targets.py), not ``get_submodule``: those are the
        user's names, which a wrapper's module tree does not have (DDP's
        ``module.``), and the user's types (not ``FullyShardedDataParallel``).
        The owner is the module the parameter is registered on; FSDP1's flat
        parameter is named as the user's parameter it holds the non-finite
        element of (:func:`parameter_place`).
        """
        roots = list(self.watch.targets.roots)
        holder = _holder(roots, finding, parameter) if len(roots) > 1 else None
        if holder is not None:  # two models share names (an EMA teacher, a GAN's ``main.0``): the one holding it
            roots.sort(key=lambda item: item[1] is not holder)
        place = parameter_place(finding.tensor.name or "", (root for _label, root in roots), finding.bad)
        if place is None:
            return  # a parameter outside every watched model: no module owns it
        if place.name != finding.tensor.name:
            finding.tensor = dataclasses.replace(finding.tensor, name=place.name)
        # In the holding model by its module objects (two models may share a label too), else by name (a gradient
        # tensor that two models' parameters share: the name is found in the other one).
        known = self.watch.targets.modules
        info = next((found for module in holder.modules() if (found := known.get(id(module))) is not None
                     and found.name == place.module), None) if holder is not None else None
        info = info or self.watch.targets.info_by_name(place.module)
        if info is not None:
            finding.module, finding.module_type, finding.model = place.module, info.module_type, info.model


def _holder(roots: list[tuple[str | None, torch.nn.Module]], finding: Finding, parameter: torch.Tensor | None
            ) -> torch.nn.Module | None:
    """The model that holds ``parameter`` (the optimizer's, for a state tensor), else whose parameter (or its
    ``.grad``, for a gradient) ``finding.bad`` is, by its memory; None where none is (a replay's scratch
    gradient). At an event of a watch of several models only."""
    if parameter is not None:
        return next((root for _label, root in roots if any(p is parameter for p in root.parameters())), None)
    bad, gradient = finding.bad, finding.tensor.role is TensorRole.PARAMETER_GRADIENT
    if bad is None:
        return None
    for _label, root in roots:
        for own in root.parameters():
            held = own.grad if gradient else own
            if held is not None and (held is bad or _same_memory(held, bad)):
                return root
    return None


def _same_memory(held: torch.Tensor, bad: torch.Tensor) -> bool:
    """Whether ``bad`` (a detached view) is ``held``'s values: by memory, as ``detach()`` made a new object. A sparse
    gradient (``nn.Embedding(sparse=True)``) has no data pointer of its own: its values' and indices' are compared."""
    if held.layout is not bad.layout or held.shape != bad.shape:
        return False
    if held.layout is torch.strided:
        return held.data_ptr() == bad.data_ptr()
    if held.layout is torch.sparse_coo:
        return (held._values().data_ptr() == bad._values().data_ptr()
                and held._indices().data_ptr() == bad._indices().data_ptr())
    if held.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return held.values().data_ptr() == bad.values().data_ptr()
    return False


def _running(code: CodeType) -> FrameType | None:
    """The innermost frame running ``code`` in this thread, or None (a walk up the stack; at an event only)."""
    here: FrameType | None = sys._getframe(1)
    while here is not None and here.f_code is not code:
        here = here.f_back
    return here


def held_state(opt: torch.optim.Optimizer, parameter: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """The first floating state tensor of ``parameter`` in ``opt`` that holds a non-finite value, with its key.

    Read only at an event (a parameter a bounded step left non-finite), one state tensor at a time.
    """
    for key, value in opt.state.get(parameter, {}).items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(value.isfinite().all()):
            return str(key), value
    return None


def _blame_state(finding: Finding, parameter: TensorRef, held: tuple[str, torch.Tensor]) -> None:
    """Report the state tensor ``held`` (key, tensor) of ``parameter`` instead: a value no watched code produced."""
    key, state = held
    finding.phase, finding.bad = Phase.DATA, state.detach()
    finding.tensor = TensorRef(TensorRole.OPTIMIZER_STATE, parameter.name, key)


def read_step_result(result: StepResult) -> list[float]:
    """A step result's values, read now: one per tensor of ``result.updated``, as :meth:`StepReports.step_result`
    judges them (a sum that is not finite is followed by a norm each, read at once)."""
    values = read_scalars(result.norms)
    if result.summed and not math.isfinite(values[0]):
        values = read_scalars(norms(result.updated, finiteness_only=True))
    return values
