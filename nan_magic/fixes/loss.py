"""The trial's loss: the step's recorded loss code run again on the remedied model's outputs.

The loss code runs outside the model (``loss = F.cross_entropy(model(x), y)``).
The watch records its ops (localize/outside/recorder.py): references to their
arguments, the user's line. A fix trial reruns the ops that led to the tensor
``backward()`` started from, with the model's outputs swapped for the
trial's and copies of everything else they read (the targets), so the
replayed step is forward, loss, backward and optimizer step, and "finite end
to end" covers the loss. A ``scaler.scale(loss)`` at the end is left out: the
trial reports the loss itself, and scales its gradient as its step does.

Which step's loss code: the failing step's, where it ran before the event (a
backward or optimizer event, and every event of the deferred check, which
judges the step at its optimizer step). A forward event in the default mode
stops the step before its loss code runs: the last step's is used, with what
that step's code read besides the model's outputs (its targets), where the
recorder kept it (with ``keep_last_good``: keeping it costs a copy of its
records each step, and that option's step already pays more). Its model
outputs are known by the records of the call (this step) or, for the last
step, as the inputs that required gradients and are no parameter, where there
is exactly one; otherwise the trial says why no loss was computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from nan_magic.fixes.site import InRecordedCode
from nan_magic.hot.kept.rng import RngState, generators_at
from nan_magic.hot.reads import values_to_read
from nan_magic.localize.outside.recorded_ops import (
    Gone,
    RecordedOp,
    WeakRecord,
    copies_from_outside,
    record_key,
    rerun_op,
)
from nan_magic.localize.outside.recorder import OutsideRecorder
from nan_magic.localize.replay.tiered.root_calls import RootCall
from nan_magic.note_records import Note

__all__ = ["LossCode", "LossNotComputed", "LossSource", "loss_code", "ran_without_grad", "unjudged",
           "with_code_before"]


class LossNotComputed(Exception):
    """The recorded loss code could not be run on the trial's outputs (``reason`` says why)."""

    def __init__(self, reason: Note) -> None:
        super().__init__(reason.kind)
        self.reason = reason


@dataclass(frozen=True)
class LossSource:
    """What the watch holds of the loss code: its recorder, the id of the tensor the last ``backward()`` started
    from, the GradScalers seen, and whether the event is judged at the deferred check after the step's loss code ran
    (not as a step's first model call returns, before it: hot/timing.py's ``judging``)."""

    recorder: OutsideRecorder | None
    key: int | None
    scalers: Iterable[object]
    judged_at_check: bool


@dataclass(frozen=True)
class LossCode:
    """The recorded ops that made the loss, ready to run on a trial's outputs."""

    ops: list[RecordedOp]
    #: The id the loss had when recorded (its op's output).
    key: int
    #: The recorded id of each model output the ops read -> its path in the call's output (``output[0]``).
    outputs: dict[int, str]
    rng: RngState | None
    #: Whether these are the last step's ops (a forward event stopped the failing step before its loss code).
    last: bool
    #: The step's other calls of the replayed module whose outputs the ops read (Barlow Twins' ``model(x1)``,
    #: ``model(x2)``): a trial replays them too, remedied as an edit of the line remedies every call (step.py).
    others: tuple[RootCall, ...] = ()
    #: The recorded id of each of their outputs the ops read -> (its call's index in ``others``, its path).
    other_outputs: tuple[tuple[int, int, str], ...] = ()

    @property
    def differentiates(self) -> bool:
        """Whether the code ran a backward of its own (``torch.autograd.grad``: a gradient penalty), recorded as the
        ops it ran: the derivative of the lines as they ran, which a remedy at one of them does not change."""
        return any("_backward" in str(op.func) for op in self.ops)

    @functools.cached_property
    def hand_backward(self) -> str | None:
        """The custom ``torch.autograd.Function`` applied in the loss code on the loss's gradient path, or None: a
        trial runs the ops its forward ran again one by one, so its backward through them is torch's derivative of
        each, not the Function's own (a ``log`` whose backward by hand is ``grad / p``: a clamp of ``p`` before the
        log leaves that ``grad / p`` inf, where the trial's ``log`` derivative reads the clamped ``p``).

        Read from autograd, not from the code's names: a tensor an op of the loss code returned whose node is a
        Function's (its ``forward`` ran that op, in a helper too; old-style or with ``setup_context``), and that
        node in the recorded loss's graph (a Function under ``no_grad`` makes no node; one whose output the loss
        does not read is not in its graph). Where the loss itself was freed, an output that required gradients
        stands for the path."""
        made: list[tuple[object, type, bool]] = []  # (the node or None, its Function, the output required grad)
        for op in self.ops:
            for value in tree_leaves(op.out):
                tensor = _resolved(value)
                node = getattr(tensor, "grad_fn", None)
                function = getattr(node, "_forward_cls", None) or getattr(value, "function", None)
                if isinstance(function, type):
                    made.append((node if tensor is not None else None, function,
                                 bool(getattr(tensor if tensor is not None else value, "requires_grad", False))))
        if not made:
            return None
        loss = next((_resolved(value) for op in self.ops for value in tree_leaves(op.out)
                     if record_key(value) == self.key), None)
        graph = _nodes_of(loss.grad_fn) if loss is not None and loss.grad_fn is not None else None
        for node, function, requires_grad in made:
            if (node in graph) if graph is not None and node is not None else requires_grad:
                return function.__qualname__
        return None

    def run(self, outputs: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
            remedied: InRecordedCode | None = None, others: list[dict[str, torch.Tensor]] | None = None,
            parameters: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The loss of ``outputs`` (by path, with their graph); ``rows``: the samples kept (skip-batch), which the
        targets lose too; ``remedied``: a remedy at the loss code's producer (site.py); ``others``: the replayed
        outputs of :attr:`others`' calls, in order (None: their recorded values are read); ``parameters``: the
        trial's copies of the model's parameters by their original's id, read where the ops read a parameter (a
        penalty on the weights; the weights in the formulas of the code's own ``autograd.grad(create_graph=True)``,
        a PINN's derivative by its input): a detached copy in their place would carry none of that code's gradient
        to the parameters the trial judges. Raises :class:`LossNotComputed`."""
        given = {key: outputs[path] for key, path in self.outputs.items() if path in outputs}
        if len(given) != len(self.outputs):
            raise LossNotComputed(Note("other-outputs"))
        for key, other, path in [(key, others[index], path) for key, index, path in self.other_outputs
                                 ] if others is not None else ():
            if path not in other:
                raise LossNotComputed(Note("other-outputs"))
            given[key] = other[path]
        given.update(_read_not_written(self.ops, parameters or {}))
        try:
            copies, _requiring = copies_from_outside(self.ops, given=given)
            if rows is not None:
                size = rows.shape[0]
                for key, tensor in list(copies.items()):
                    if key not in given and tensor.dim() > 0 and tensor.shape[0] == size:
                        copies[key] = tensor[rows.to(tensor.device)]
            with torch.enable_grad(), generators_at(self.rng):
                for op in self.ops:
                    with torch.no_grad() if ran_without_grad(op) else contextlib.nullcontext():
                        rerun_op(op, copies, remedied.run if remedied is not None else None)
        except Gone:
            raise LossNotComputed(Note("loss-input-freed")) from None
        except Exception as error:  # an op of the user's code refusing the remedied outputs (another shape)
            raise LossNotComputed(Note.of("loss-code-raised", error=type(error).__name__)) from error
        loss = copies[self.key]
        if loss.numel() != 1 or not loss.is_floating_point():
            raise LossNotComputed(Note("loss-not-scalar"))
        return loss


def loss_code(source: LossSource, root: RootCall, before_loss: bool, calls: Iterable[RootCall] = ()
              ) -> LossCode | Note:
    """The loss code a trial of ``root``'s step runs, or why there is none.

    ``before_loss``: the event came before the step's loss code ran (a forward or data event, not deferred);
    ``calls``: the step's model calls, whose other calls of ``root``'s module the trial replays where the loss code
    reads their outputs.
    """
    recorder = source.recorder
    if recorder is None:
        return Note("ops-mode-loss-code")
    if "loss" in recorder.untraced:
        return Note("loss-code-untraced")
    last = before_loss and not source.judged_at_check
    if source.key is None:
        if last:
            return Note("no-earlier-backward")
        return Note("backward-not-from-tensor")
    # The default mode lets the step's records go as its backward pass ends (kept as the last step's): a backward
    # event's trials, run after that, find them there.
    found = recorder.loss_code(source.key, last) or (recorder.loss_code(source.key, True) if not last else None)
    if found is None:
        if last and not recorder.keep_last:
            return Note("last-loss-code-not-kept")
        return Note("last-loss-not-recorded" if last else "loss-not-recorded")
    ops, rng = found
    ops, key = _unscaled(ops, source.key, {id(scale) for scaler in source.scalers
                                           if isinstance(scale := getattr(scaler, "_scale", None), torch.Tensor)})
    outputs = _model_outputs(ops, root, last)
    if isinstance(outputs, Note):
        return outputs
    others: list[RootCall] = []
    other_outputs: list[tuple[int, int, str]] = []
    if not last and (read := _nonfinite_of_another_model(ops, root, calls)) is not None:
        return read
    if not last:
        # Read as recorded, their outputs hold the unremedied line's NaN (both views of a siamese step): the
        # remedied trial's loss came out NaN where the edit, by hand, remedies every call and trains on.
        for call in calls:
            if call is root or call.module is not root.module:
                continue
            found_outputs = _model_outputs(ops, call, False)
            if isinstance(found_outputs, dict):
                other_outputs.extend((key, len(others), path) for key, path in found_outputs.items()
                                     if key not in outputs)
                others.append(call)
    return LossCode(ops, key, outputs, rng, last, tuple(others), tuple(other_outputs))


def with_code_before(code: LossCode, records: OutsideRecorder) -> LossCode | Note:
    """``code`` run from the loop's code before the model call that made a non-finite value it reads; or why not.

    ``weight = 1 / torch.bincount(y)`` before ``model(x)``, read by the loss after it: a class no sample has made an
    inf that never entered the model (a ``data`` event, but no batch to leave samples out of). Run again ahead of the
    loss code's own ops, that code's line takes the trial's remedy as the loss code's do (``counts.clamp_min(eps)``).
    """
    before: list[RecordedOp] = []
    for value in _outside(code.ops).values():
        tensor = value.ref() if isinstance(value, WeakRecord) else value
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or bool(
                torch.isfinite(values_to_read(tensor)).all()):
            continue
        found = records.data_code(tensor)
        if found is None:
            return Note("loss-input-not-recorded")
        ops, rng = found
        if rng is not None:  # (its generators' state is the data region's, the loss code's another)
            return Note("loss-input-random")
        seen = {id(op) for op in before}
        before.extend(op for op in ops if id(op) not in seen)
    if not before:
        return Note("loss-input-finite")
    return dataclasses.replace(code, ops=[*before, *code.ops])


def _nonfinite_of_another_model(ops: list[RecordedOp], root: RootCall, calls: Iterable[RootCall]) -> Note | None:
    """Why the loss code cannot run on the trial's outputs where it reads another model's output that came out
    non-finite (None: it reads none).

    A GAN's ``disc(gen(z).detach()).mean()``: the discriminator's call read the generator's unremedied NaN, and
    the trial replays the generator alone; read as recorded, the discriminator's NaN made the remedied step's loss
    NaN, and the trial said "still non-finite (loss)" of an eps that, by hand, trains on
    (two_optimizers_not_passed, in the deferred mode, which judges the step after its loss code ran)."""
    inputs = list(_outside(ops).values())
    for call in calls:
        if call.module is root.module or call.call is None:
            continue
        for record in call.call.outputs:
            tensor = record.ref()
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or bool(
                    torch.isfinite(values_to_read(tensor)).all()):
                continue
            if any((record.ref is value.ref) if isinstance(value, WeakRecord) else (tensor is value)
                   for value in inputs):
                return Note.of("another-model-nonfinite", model=type(call.module).__name__)
    return None


def unjudged(code: LossCode | Note | None, failed: str | None, loss_from: str | None, deliberate: bool = False
             ) -> Note | None:
    """Why a trial's verdict says nothing of the user's step, where it ran the loss code (``code``) and ``failed``
    there or not at all; None where its verdict stands. ``deliberate``: the remedied outputs kept infinities taken
    as deliberate (a mask's -inf, deliberate.py), which only the user's loss can judge."""
    if deliberate and failed is None and loss_from not in ("loss code", "last loss code", "model"):
        # (A backward from ones goes through a masked_fill as zeros; the user's loss may read the -inf: an entropy
        # bonus ``p * logp`` is 0 * -inf, NaN, at every masked entry.)
        return Note("deliberate-infinities")
    if not isinstance(code, LossCode):
        return None
    if failed == "loss" and code.differentiates:
        return Note("loss-code-differentiates")
    function = code.hand_backward
    if function is not None and loss_from in ("loss code", "last loss code") and failed not in ("forward", "loss",
                                                                                                  "raised"):
        return Note.of("hand-backward", function=function)
    return None


def _read_not_written(ops: list[RecordedOp], parameters: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The ``parameters`` (by recorded id) that ``ops`` read and none writes in place: a trial's parameter is a leaf
    that requires gradients, which an in-place op refuses (the detached copy the replay takes instead is written)."""
    written = {record_key(op.args[0]) for op in ops
               if op.args and getattr(getattr(op.func, "overloadpacket", None), "__name__", "").endswith("_")}
    return {key: parameters[key] for key in _outside(ops) if key in parameters and key not in written}


def _resolved(value: object) -> torch.Tensor | None:
    """A recorded tensor if it is still alive (held, or a weak record's referent), else None."""
    if isinstance(value, torch.Tensor):
        return value
    return value.ref() if isinstance(value, WeakRecord) else None


def _nodes_of(root: object, most: int = 200_000) -> set[object]:
    """The autograd nodes ``root`` reaches (``next_functions`` outlive a backward that freed the saved tensors)."""
    seen: set[object] = set()
    stack = [root]
    while stack and len(seen) < most:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(following for following, _index in getattr(node, "next_functions", ()))
    return seen


def ran_without_grad(op: RecordedOp) -> bool:
    """Whether ``op`` ran under ``no_grad`` (or ``inference_mode``): it read a tensor that required gradients and
    returned none that does. The replay runs it so again: SwAV's Sinkhorn codes, ``q = exp(s / eps)`` normalised in
    place under ``no_grad``, would otherwise be a graph whose saved ``exp`` output the in-place divisions modify, and
    a trial's backward through it raise autograd's in-place error. (An op that has no derivative returns nothing
    that requires gradients either: it computes the same under ``no_grad``.)"""
    outs = [value for value in tree_leaves(op.out) if record_key(value) is not None]
    ins = [value for value in tree_leaves((op.args, op.kwargs)) if record_key(value) is not None]
    return bool(outs) and any(map(_requires_grad, ins)) and not any(map(_requires_grad, outs))


def _requires_grad(value: object) -> bool:
    return bool(getattr(value, "requires_grad", False))  # a tensor's, or a WeakRecord's (the original's)


def _unscaled(ops: list[RecordedOp], key: int, scales: set[int]) -> tuple[list[RecordedOp], int]:
    """The ops and key of the loss before ``scaler.scale(loss)`` (a mul by a GradScaler's scale tensor), if last."""
    op = ops[-1]
    if op.func is torch.ops.aten.mul.Tensor and len(op.args) == 2:
        first, second = (record_key(value) for value in op.args)
        if second in scales and first is not None:
            return ops[:-1], first
    return ops, key


def _outside(ops: list[RecordedOp]) -> dict[int, object]:
    """The recorded values the ops read that no earlier op returned, by their recorded id, in order."""
    made: set[int] = set()
    found: dict[int, object] = {}
    for op in ops:
        for value in tree_leaves((op.args, op.kwargs)):
            key = record_key(value)
            if key is not None and key not in made:
                found.setdefault(key, value)
        made.update(key for key in map(record_key, tree_leaves(op.out)) if key is not None)
    return found


def _model_outputs(ops: list[RecordedOp], root: RootCall, last: bool) -> dict[int, str] | Note:
    """The recorded id of each output of ``root``'s call that the ops read -> its path; or why none is known."""
    inputs = _outside(ops)
    records = root.call.outputs if root.call is not None and not last else []
    outputs: dict[int, str] = {}
    for record in records:
        for key, value in inputs.items():
            # A weak record shares the call record's weak reference (CPython keeps one per tensor), alive or not.
            if (record.ref is value.ref) if isinstance(value, WeakRecord) else (record.ref() is value):
                outputs[key] = str(record.path)
    if outputs:
        return outputs
    if not last:
        return Note("loss-reads-no-output")
    parameters = {id(parameter) for parameter in root.module.parameters()}
    grads = [key for key, value in inputs.items()
             if getattr(value, "requires_grad", False) and key not in parameters]
    paths = [str(record.path) for record in root.call.outputs] if root.call is not None else []
    if len(grads) != 1 or len(paths) != 1:
        return Note.of("outputs-unknown", grads=len(grads), paths=len(paths))
    return {grads[0]: paths[0]}
