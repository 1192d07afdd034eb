"""When a step's values are read and judged: one object per mode, chosen once (:func:`timing_for`).

* :class:`Immediate` (the CPU default): a value is read as it is made, a
  call's outputs are judged as it returns, the loss as ``backward()``
  starts, a gradient as it arrives. A read costs nothing but the read on the
  CPU, and the event stops the step where the value was made, with the
  producer's frame still running.
* :class:`Deferred` (``defer=True``; the default on a GPU and under a process
  group): nothing is read mid-step. A record keeps its probe on the device;
  the step's check (:meth:`Deferred.check`, called by
  :meth:`StepCycle.sync <nan_magic.hot.step_cycle.StepCycle.sync>` at the
  optimizer step's pre-hook) reads every probe in one transfer, the step's
  one host sync, and judges the step's calls in the order they returned. A
  producer is then long gone from the stack: its op and line come from
  what its call kept (its arguments, held weakly; its RNG state), replayed.

Everything that differs between the two lives here; the checks and the step
cycle call these methods at their own points and never ask which mode they
are in. The checks below see the mode through the ``WhenJudged`` Protocol
(checks/hosts.py). Above the hot path, the watch passes the mode's facts to
what it builds: the step log whether records hold their probes, the call
replays whether a producer is replayed from its running frame or from what
its call kept (localize/replay/producer_call.py), the fix trials whether an
event came after the loss code ran (fixes/loss.py).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from nan_magic.distributed.ranks import launched
from nan_magic.errors.exceptions import NonFiniteError
from nan_magic.hot.kept.lines import LINES, line_at
from nan_magic.hot.reads import WIDE_FLOATS, read_scalars
from nan_magic.hot.watched.transparent import dropped_by_a_pass_through
from nan_magic.options import WatchConfig
from nan_magic.records import Note, Phase

if TYPE_CHECKING:
    from nan_magic.hot.checks.backward.gradient_checks import GradientChecks
    from nan_magic.hot.checks.hosts import CodeRecorder
    from nan_magic.hot.kept.call_records import Call
    from nan_magic.hot.step_cycle import StepCycle

__all__ = ["Deferred", "Immediate", "Timing", "timing_for"]

T = TypeVar("T")

#: What a report found at the deferred check says (one note for every such report).
_DETECTED_DEFERRED = Note("detected-deferred")


def timing_for(config: WatchConfig, roots: Iterable[nn.Module]) -> Timing:
    """Deferred checks by default where the models (``roots``) live on a GPU (but under ``ops=True``), and under a
    process group.

    Under a process group, every check of a step is then judged at the
    optimizer step's pre-hook, the one point where all ranks can agree
    to stop (agreement.py).
    """
    deferred = config.defer
    if deferred is None:
        # ops=True reads every op's output as it runs (a host read each): deferring the boundaries saves nothing
        # there, and the deferred check would meet what the step freed since. Ranks that must agree defer anyway.
        deferred = launched() or (not config.ops and any(
            parameter.device.type != "cpu" for root in roots for parameter in root.parameters()
        ))
    return Deferred() if deferred else Immediate()


class Timing:
    """The two modes' common face: what the engine asks of the mode it runs in."""

    #: Whether values are judged at the step's check rather than as they are made (``Watch.defer``).
    deferred = False
    #: Whether a record keeps its probe on the device until the step's check (call_records.TensorRecord):
    #: the one fact the per-record hot path reads, as a plain attribute.
    holds_probes = False
    #: Whether large CPU gradients are measured in backward, while in cache (step_checks.py's "Hot gradients"): the
    #: immediate mode's. The deferred mode's steps run on a GPU, whose fused read is one kernel, or under a
    #: process group, whose gradients the reduction rewrites after they accumulate.
    measures_in_backward = False
    #: What is judging the step's values now: ``"check"``, the deferred check at the optimizer step (or the watch's
    #: exit), after the step's loss code ran; ``"model-return"``, the check as an inference call returns (no
    #: optimizer stepped yet: step 0 too), before it; None elsewhere. An event's fix trials read it (fixes/loss.py).
    judging: str | None = None

    def now(self, judge: Callable[..., None], *args: Any) -> None:
        """``judge(*args)`` where values are judged as they are made; nothing where the step's check judges them.

        What the checks do for a value (or a region of code) at the moment it
        is made, in the immediate mode only: judging a call's outputs, the
        loss, a gradient; letting the loss code's records go as its backward
        ends. The deferred mode does each at the step's check (:meth:`check`,
        :meth:`step_judged`).
        """

    def finite_by_sum(self, tensor: torch.Tensor, known: bool) -> bool:
        """Whether a gradient is known finite now: ``known`` (found so before: StepLog.gradient_seen), or by its sum.

        A sum takes a third of a probe's time on the CPU; only finiteness is
        asked of a float32 gradient (its range shows only a half-precision
        one's headroom).
        """
        return False

    def free_read(self, read: Callable[[], T]) -> T | None:
        """``read()`` where a host read costs nothing more (a GradScaler's scale for the history), else None."""
        return None

    def check(self, cycle: StepCycle, extra: list[torch.Tensor], first: Callable[[list[float]], None] | None
              ) -> list[float]:
        """The step's check: read ``extra`` scalars (and what the step left pending); return ``extra``'s values.

        ``first`` judges those values before any call is (the previous
        optimizer step's result: a step that made a parameter non-finite
        comes before the forward that then read it).
        """
        # Every call was judged as it returned (or the watch stands down): only ``extra`` is new.
        values = read_scalars(extra) if extra else []
        if first is not None:
            first(values)
        return values

    def update_code_ended(self, cycle: StepCycle, written: list[torch.Tensor], by_a_call: bool) -> bool:
        """The loop's update code wrote parameters (localize/outside/loop_writes.py): their norms are judged. True
        where they are held to be judged later (the records that name their writer must stay until then)."""
        raise NotImplementedError

    def loss_logged(self, gradients: GradientChecks, call: Call, loss: torch.Tensor) -> None:
        """``backward()`` starts from ``loss``, logged as ``call``: judge it, or keep what its check needs."""
        raise NotImplementedError

    def step_judged(self, outside: CodeRecorder) -> None:
        """After the optimizer step: the code recorder's next region, the code until the next model call.

        Data loading, within a budget. Starting it lets the step's records
        go: the loss code's, which the deferred check held for the step, and
        the last data region's, which it held until it had judged the batch.
        """
        outside.start("data")

    def carries_step_result(self, bounded: bool, wild: Callable[[], bool]) -> bool:
        """Whether an optimizer step's result is read with the next check, not now (step_checks.py).

        ``bounded``: the step cannot make a parameter non-finite;
        ``wild()``: its hyperparameters can (step_layout.py), so it is read now.
        """
        return False

    def pending_at_exit(self, cycle: StepCycle) -> NonFiniteError | None:
        """An exception leaves the watch: the event of a value made before it and not judged yet, if any."""
        return None


class Immediate(Timing):
    """Every value judged as it is made (see the module docstring)."""

    measures_in_backward = True

    def now(self, judge: Callable[..., None], *args: Any) -> None:
        judge(*args)

    def finite_by_sum(self, tensor: torch.Tensor, known: bool) -> bool:
        # (-inf < sum < inf, not math.isfinite: a call less a gradient; NaN fails the comparison. Detached only where
        # it needs a gradient, a create_graph backward's: the others record no graph, and a detach is an op each.)
        return (tensor.is_cpu and tensor.dtype in WIDE_FLOATS and tensor.layout is torch.strided
                and (known or -math.inf < float((tensor.detach() if tensor.requires_grad else tensor).sum())
                     < math.inf))

    def free_read(self, read: Callable[[], T]) -> T | None:
        return read()

    def update_code_ended(self, cycle: StepCycle, written: list[torch.Tensor], by_a_call: bool) -> bool:
        cycle.judge_written(read_scalars(written))
        return False

    def loss_logged(self, gradients: GradientChecks, call: Call, loss: torch.Tensor) -> None:
        # (a finite loss, every step's, has nothing to judge: judge_loss's first test; the last output is the
        # gradient the loop gave backward where it gave one, else the loss again)
        if call.outputs[0].kinds or call.outputs[-1].kinds:
            gradients.judge_loss(call)  # before its records let go of anything: a replay of its ops may need it
        if (outside := gradients.watch.outside) is not None:  # (weaken_loss_code, inlined: every backward)
            outside.weaken()


class Deferred(Timing):
    """Every value judged at the step's check, from one transfer (see the module docstring)."""

    deferred = True
    holds_probes = True

    def check(self, cycle: StepCycle, extra: list[torch.Tensor], first: Callable[[list[float]], None] | None
              ) -> list[float]:
        entered = self.judging is None  # (an inference call's return has said "model-return")
        if entered:
            self.judging = "check"
        try:
            written, first_count = cycle.take_written()
            if cycle.outcome.stopped:
                return super().check(cycle, extra, first)
            values = cycle.log.resolve(extra + written)
            values, written_values = values[:len(extra)], values[len(extra):]
            if first is not None:
                first(values)
                if (held := cycle.held).finding is not None and held.finding.step != cycle.step:
                    held.settle()  # the batch of the step whose parameters ``first`` judged: handled (held_batch.py)
            outcome = cycle.outcome  # (its ``stopped`` is asked again after every judgement)
            if first_count and not outcome.stopped:
                # The loop's code that ran before the calls (a data region, ended as one began) is judged first.
                cycle.judge_written(written_values[:first_count])
            if outcome.stopped:
                return values
            finished = cycle.log.finished() if cycle.log.any_kinds() else []  # (none, most steps: no sort of them)
            for index, call in enumerate(finished):
                for record in call.outputs:
                    if record.kinds:
                        break
                else:
                    continue  # every output read finite: the judges would return at once
                if call.phase == Phase.BACKWARD:
                    if not dropped_by_a_pass_through(call, islice(finished, index + 1, None)):
                        cycle.gradients.judge(call)
                elif call.info is None:
                    cycle.gradients.judge_loss(call)
                else:
                    for record in call.outputs:
                        if record.status == "ok":
                            cycle.judge_forward(call, record, _DETECTED_DEFERRED)
                if outcome.stopped:
                    break
            if written and len(written) > first_count and not outcome.stopped:  # (no len() call on most steps)
                cycle.judge_written(written_values[first_count:])  # after the calls: the update code ran after them
            return values
        finally:
            if entered:
                self.judging = None

    def update_code_ended(self, cycle: StepCycle, written: list[torch.Tensor], by_a_call: bool) -> bool:
        cycle.hold_written(written, by_a_call)  # read with this step's single transfer
        return True

    def loss_logged(self, gradients: GradientChecks, call: Call, loss: torch.Tensor) -> None:
        if (outside := gradients.watch.outside) is not None:  # (weaken_loss_code, inlined: every backward)
            outside.weaken()
        gradients.keep_loss_code(loss)
        # Where the loop called backward: a gradient judged at once stops there, and %debug opens at that line;
        # judged at the check, the loop stands at ``opt.step()`` or at the next micro-batch's model call. Below it:
        # here, the gradient check, patches/backward's _seen (or _begin), its wrapper of backward (installed
        # without a dispatch frame: registry.SelfGated); another path (a library's backward, a patch of backward
        # over ours) gives a frame of library code, which the event ignores. Kept without the frame (its locals),
        # found on the stack at an event (lifecycle/events.py); its line by instruction (lines.py: f_lineno scans
        # the line table).
        caller = sys._getframe(4)
        code = caller.f_code
        try:  # (line_at's lookup inlined, as step_keeping.py's: every deferred backward)
            line = LINES[code.co_linetable, code.co_firstlineno, caller.f_lasti] if caller.f_trace is None else (
                caller.f_lineno)
        except KeyError:
            line = line_at(caller)
        gradients.backward_caller = (code, caller.f_lasti, line)

    def carries_step_result(self, bounded: bool, wild: Callable[[], bool]) -> bool:
        return bounded or not wild()

    def pending_at_exit(self, cycle: StepCycle) -> NonFiniteError | None:
        # A step's values are judged at the optimizer step; an exception that stops the step before
        # (``torch.multinomial`` on NaN probabilities in the loop) is then raised ``from`` by the event.
        if cycle.outcome.stopped:
            return None
        try:
            cycle.sync()
        except NonFiniteError as error:
            return error
        return None
