"""Optimizer-phase checks, and what a GradScaler makes benign.

Global optimizer step hooks (no need to pass the optimizer): before a step, a non-finite gradient about to be
applied is reported; after it, a parameter or optimizer state the step made non-finite is reported as phase
``optimizer``.

GradScaler rule. With an enabled GradScaler in use, a non-finite gradient in backward is first held as *pending*: the
scaler may skip the step. A scaler is in use when it was passed to ``watch`` or when its ``scale()`` ran under the
watch (scaler_patch.py: most people never pass it). A ``scaler.step(opt)`` that made no optimizer step call is a
skipped step (seen as it returns); so is, for a scaler whose ``step`` was not seen, a new step that starts without an
optimizer step having run. The pending event is then recorded as benign (never raised). The run is not healthy, and the
watch raises, when the scale keeps collapsing: :data:`COLLAPSE_SKIPS` skipped steps in a row (with the default backoff
of 0.5, a 2**15-fold fall), or a scale below 1 (even unscaled gradients overflow). A non-finite unscaled gradient that
reaches an optimizer step is always a real fault.

Hot gradients. A large CPU gradient's norm is taken as autograd accumulates it (a post-accumulate-grad hook),
while in cache: two thirds of the time of the same read at the step, on the benchmark MLP's 34 MB. The step
uses it if the gradient is the same tensor at the same version; one changed since (clipping, ``unscale_``, an
edit) or accumulated over several backward passes is measured at the step.

A closure that runs the forward and backward inside the step (LBFGS) has its gradients judged as its backward returns
(:meth:`closure_gradients`).
Bounded steps: a step that cannot make a finite parameter non-finite has its parameters checked only every
:data:`FULL_CHECK_EVERY` steps (step_layout.py gives the argument and the conditions).
"""

from __future__ import annotations

import math
import operator
import sys
import weakref
from typing import Any

import torch
from torch import nn

from nan_magic.distributed.ranks import local_shard
from nan_magic.errors.frames import user_call
from nan_magic.hot.checks.backward.gradient_checks import check_parameter_grads
from nan_magic.hot.checks.hosts import OptimizerHost, OriginFinder
from nan_magic.hot.checks.optimizer.headroom import Headroom
from nan_magic.hot.checks.optimizer.iterations import Iterations
from nan_magic.hot.checks.optimizer.layouts import Layouts, holds
from nan_magic.hot.checks.optimizer.step_layout import (
    BOUNDED_GRAD_NORM,
    Layout,
    StepResult,
    bounded_step,
    wild_hyperparameters,
)
from nan_magic.hot.checks.optimizer.step_reports import ReplayStep, StepReports, held_state, read_step_result
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.reads import (
    DOT_MIN_NUMEL,
    WIDE_FLOATS,
    GradOff,
    dot_norm,
    is_checkable,
    norms,
    read_scalars,
    version_of,
)
from nan_magic.records import Cause, Note

__all__ = ["COLLAPSE_SKIPS", "FULL_CHECK_EVERY", "OptimizerChecks"]

#: Consecutive steps skipped by a GradScaler after which the scale counts as collapsing.
COLLAPSE_SKIPS = 15

#: A bounded step's parameters are still checked every this many steps.
FULL_CHECK_EVERY = 16


class OptimizerChecks:
    """Optimizer step hooks and the GradScaler rule for one watch.

    ``origins`` and ``replay_step`` name the op behind a finding
    (:class:`~nan_magic.hot.checks.optimizer.step_reports.StepReports`).
    """

    def __init__(self, watch: OptimizerHost, origins: OriginFinder, replay_step: ReplayStep | None = None) -> None:
        self.watch = watch
        #: What a non-finite read at a step is reported as (step_reports.py).
        self.reports = StepReports(watch, origins, replay_step)
        #: Training iterations completed, from the optimizer steps seen (iterations.py).
        self.iterations = Iterations(watch.targets.optimizers)
        self.pending_overflow: Finding | None = None
        self.skipped_in_a_row = 0
        self.skipped_total = 0
        self.last_grad_norm: float | None = None
        # Each optimizer's layout and parameter names (layouts.py); bound here, one call as a method was.
        self.layouts = Layouts(watch.targets)
        self.layout, self.named_parameters = self.layouts.layout, self.layouts.named_parameters
        # Optimizers seen stepping (targets or not), for the scene and the roll-back.
        self.seen: list[torch.optim.Optimizer] = list(watch.targets.optimizers)
        # GradScalers passed to the watch or seen scaling a loss (scaler_patch.py).
        self.scalers: list[Any] = list(watch.targets.scalers)
        # Optimizer step calls seen (any optimizer): a scaler.step that adds none skipped its step.
        self.step_calls = 0
        self._last: torch.optim.Optimizer | None = None  # the last step's optimizer: watched, and in ``seen``
        # True between an optimizer's pre and post hooks: ops then belong to the optimizer phase.
        self.in_step = False
        #: The iteration the last step's post-hook counted it in (its hooks' writes are reported there).
        self.last_step = 0
        self._stepping: torch.optim.Optimizer | None = None  # (that optimizer, for a closure's gradients)
        #: The parameters of the step whose pre-hook read ``step_ids_of``'s layout (its ``ids``, a set made once a
        #: layout): what the step replays release at its post-hook (step_cycle.py), no set built each step.
        self.step_ids_of: torch.optim.Optimizer | None = None
        self.step_ids: frozenset[int] = frozenset()
        # Deferred mode: a step's parameter/state norms, read at the next sync.
        self.carried: StepResult | None = None
        # A step whose parameters need no check after it (bounded_step); one whose gradients reach
        self._bounded = self._huge = False  # BOUNDED_GRAD_NORM, whose float32 state is checked too (_step_result)
        self._last_checked_step: int | None = None
        # Per optimizer: its last bounded step whose parameters went unchecked since its last check (flush).
        self._unchecked: dict[int, tuple[torch.optim.Optimizer, int]] = {}
        # id(parameter) -> (weak gradient, its version, its norm) taken in backward (hot gradients).
        self._hot: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
        self._hot_enabled = watch.timing.measures_in_backward
        # Half-precision parameters near their limit, copied before each step for its replay (headroom.py);
        # the reports note them from each step result judged finite.
        self._headroom = self.reports.headroom = Headroom() if replay_step is not None else None
        self._before: dict[int, torch.Tensor] = {}

    # -- hooks -------------------------------------------------------------------

    def in_use(self) -> bool:
        """Whether an optimizer is in use: one stepped under the watch, or one was passed to it."""
        return self.iterations.any_stepped or bool(self.watch.targets.optimizers)

    def watches(self, opt: torch.optim.Optimizer) -> bool:
        mine = self.watch.targets.optimizers
        return not mine or holds(mine, opt) or self.watch.targets.admit_optimizer(opt)

    def arm(self, module: nn.Module) -> list[Any]:
        """Post-accumulate-grad hooks on a watched model's parameters; their handles."""
        if not self._hot_enabled:
            return []
        # A lazy module's parameter (nn.LazyLinear before its first forward) has no size yet, and reading it raises:
        # it goes without the hook, and its gradient's norm is taken at the step, as a small one's is.
        return [
            parameter.register_post_accumulate_grad_hook(self.on_grad_accumulated)
            for parameter in module.parameters()
            if parameter.requires_grad and parameter.is_cpu and not nn.parameter.is_lazy(parameter)
            and parameter.numel() >= DOT_MIN_NUMEL
        ]

    def on_grad_accumulated(self, parameter: torch.Tensor) -> None:
        """Take a gradient's norm while it is in cache (see "Hot gradients" above)."""
        __tracebackhide__ = True  # an interrupt landing in a watch hook: IPython shows the user's frames, not ours
        if not self._hot_enabled or not self.watch.listening():
            return
        grad = parameter.grad
        if grad is None or grad.layout is not torch.strided:  # a sparse gradient: read at the step
            return
        if not grad.is_contiguous() or grad.dtype not in WIDE_FLOATS:
            return
        if id(parameter) in self._hot:
            # A second backward before the step: gradients accumulate here.
            self._hot_enabled = False
            self._hot.clear()
            return
        # A CPU parameter of DOT_MIN_NUMEL elements or more (arm): its contiguous wide gradient takes norms()' dot.
        self._hot[id(parameter)] = (weakref.ref(grad), version_of(grad), dot_norm(grad))

    def _gradient_norms(self, layout: Layout) -> list[torch.Tensor]:
        """The norms of the gradients about to be applied, as 0-d tensors not read yet (the hot path).

        Per (device, dtype) group of the layout's parameters, a fused
        ``_foreach_norm`` (one kernel on a GPU), or on the CPU for float32 and
        float64 one dot over their concatenation: the group's norm, finite
        exactly when each gradient is, and below :data:`BOUNDED_GRAD_NORM`
        only when each is. For each large CPU gradient, the norm taken in
        backward when it is unchanged since (see "Hot gradients"), else a dot
        now. No Python per parameter beyond fetching its ``.grad``: which
        gradient a norm belongs to is only worked out at an event
        (:meth:`StepReports.gradients`), by measuring them again one by one.
        """
        hot, self._hot = self._hot, {}
        if layout.generic:
            return norms([grad for _name, grad in self._named_gradients(layout)])
        result: list[torch.Tensor] = []
        # Inference mode (grad off too), not a detach per gradient (a create_graph backward's gradients require
        # grad): the view per gradient that the flat copy makes skips autograd's view tracking, 15-20% of this read
        # (benchmarks/README.md, thirtieth round). The norms are inference tensors, only ever read. (Nothing here
        # pushes or pops a dispatch mode: the guard puts the key set back as it found it.)
        with _INFERENCE(True):
            for group in layout.groups:
                grads = [grad for parameter in group if (grad := parameter.grad) is not None]
                if not grads:
                    continue
                try:
                    if layout.flat_ok and grads[0].is_cpu and grads[0].dtype in WIDE_FLOATS:
                        # One copy into a flat buffer and one BLAS dot: on the CPU, _foreach_norm is a
                        # norm call per tensor, about twice the time for a tiny model's gradients.
                        flat = _flatten(grads)  # (dot_norm, inlined: flat, and no graph with grad off)
                        result.append(torch.dot(flat, flat).sqrt_())
                    else:
                        result += torch._foreach_norm(grads, 2)  # one fused kernel on a GPU
                except (RuntimeError, NotImplementedError):
                    # A sparse gradient (``nn.Embedding(sparse=True)``) has no fused norm: this layout is
                    # measured the generic way from now on (reads.norms reads its stored values).
                    layout.generic = True
                    return norms([grad for _name, grad in self._named_gradients(layout)])
        for parameter in layout.large:
            grad = parameter.grad
            if grad is None:
                continue
            entry = hot.get(id(parameter))
            if entry is not None and entry[0]() is grad and entry[1] == version_of(grad):
                result.append(entry[2])
            else:
                result += norms([grad])
        return result

    @staticmethod
    def _named_gradients(layout: Layout) -> list[tuple[str, torch.Tensor]]:
        """The gradients about to be applied, under their parameters' names (a sharded one as this rank's shard)."""
        named = [(name, local_shard(parameter.grad)) for name, parameter in layout.floating]
        return [(name, grad) for name, grad in named if grad is not None]

    def on_step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before a step: the previous step's result, then the running statistics and gradients about to be applied,
        read in one transfer (the deferred mode's one host synchronisation per step)."""
        watch = self.watch
        if not watch.here.mine:
            return
        self.step_calls += 1
        if opt is not self._last:  # (the usual step's optimizer is the last one's: no call to ask again)
            if not self.watches(opt):
                return
            if not holds(self.seen, opt):
                self.seen.append(opt)
            self._last = opt
        self._bounded = False
        layout = self.layout(opt)
        self.step_ids_of, self.step_ids = opt, layout.ids
        grad_norms = self._gradient_norms(layout)
        running = layout.running.norms() if layout.running is not None else []  # (BatchNorm's: running_stats.py)
        carried, self.carried = self.carried, None
        carried_norms = carried.norms if carried else []

        def judge_carried(values: list[float]) -> None:
            # The previous step's result first: the forward since read what it made non-finite. Finite, the state
            # copied after it is the last good one before this step's calls are judged (last_good.py).
            if carried is not None and not self.reports.step_result(carried, values[: len(carried_norms)],
                                                                     next_check=True, stepping=opt):
                watch.last_good.promote()

        values = watch.cycle.sync(carried_norms + grad_norms + running, judge_carried)
        # (No len() where none is carried: most steps.)
        grad_values = values[len(carried_norms) :] if carried_norms else values[:]
        if running:  # this step's forward wrote them, before its backward made the gradients: judged first
            if not all(map(math.isfinite, grad_values[len(grad_norms) :])) and (written := layout.running.judge()):
                watch.emit(written)
            del grad_values[len(grad_norms) :]
        # hypot: NaN if any value is, inf if any is; never overflows on finite values.
        self.last_grad_norm = norm = math.hypot(*grad_values) if grad_values else None
        # (Finiteness by comparison, asked once: NaN fails it; not math.isfinite twice, every step.)
        norm_finite = norm is None or -math.inf < norm < math.inf
        if not norm_finite and self.reports.gradients(opt, self._named_gradients(layout)):
            return
        # (A NaN norm makes the hypot non-finite; max() alone would skip it.)
        small = norm is None or (norm_finite and max(grad_values) < BOUNDED_GRAD_NORM)
        self._bounded = small and bounded_step(opt, layout)
        self._huge = not small  # (finite: a non-finite one was reported above)
        if self._headroom is not None:
            self._before = self._headroom.copies(opt) if self._headroom.at_risk else {}
        self.in_step, self._stepping = True, opt

    def closure_gradients(self) -> None:
        """A closure's backward returned inside the step: the step's check, the gradients it then applies too."""
        opt = self._stepping
        if opt is not None and self.watches(opt):
            layout = self.layout(opt)
            if not all(map(math.isfinite, self.watch.cycle.sync(self._gradient_norms(layout)))):
                self.reports.gradients(opt, self._named_gradients(layout))

    def on_step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """After a step: parameters and optimizer state it made non-finite (phase ``optimizer``)."""
        watch = self.watch
        if not watch.here.mine:
            return
        step = self.last_step = self.iterations.stepped(opt)  # watched or not: the index of its iteration
        if opt is not self._last and not self.watches(opt):
            return
        try:
            # A bounded step needs no check (module docstring), except every FULL_CHECK_EVERY steps, and whenever
            # the roll-back snapshot is kept: it must only ever hold checked parameters.
            if self._bounded and step % FULL_CHECK_EVERY != 0 and watch.last_good.where is None:
                self._unchecked[id(opt)] = (opt, step)  # checked at the watch's end if no full check comes first
                return
            self._unchecked.pop(id(opt), None)
            # After gradients of 1e18+ (_huge) read now, its gradient in place (a later replay applies the next one's);
            # not a fused step under a GradScaler (opt.grad_scale set): scaled gradients pass 1e18 on healthy runs.
            huge = self._huge and getattr(opt, "grad_scale", None) is None
            carry = watch.timing.carries_step_result(self._bounded, lambda: huge or wild_hyperparameters(opt))
            result = self._step_result(opt, step, self._bounded, read_now=not carry)
            if carry:
                # Read with the next step's single transfer, not now (a step with wild hyperparameters is read
                # now, step_layout.py); a replay of an unbounded step then names the line that called it.
                # (Its frame too, with where it stood, only where its locals are its module's globals: a cell's or a
                # script's top level, whose frame has returned when the watch is left; %debug opens there at the
                # step's line. A function's frame (a train_step helper) would keep its locals, the batch and the
                # logits, alive into the next step: its frame is looked for among the running ones at the check.)
                called = None if self._bounded else user_call(sys._getframe(1))
                if called is not None:
                    result.caller, frame, result.caller_lasti = called
                    if frame.f_code.co_name == "<module>":
                        result.caller_frame = frame
                # The groups' rates as the step ran (a tensor rate the loop rebinds by the check): a C map, no call.
                result.lrs = list(map(_GROUP_LR, opt.param_groups))
                self.carried = result
                if watch.last_good.where is not None:  # (copied as it is now, kept once the check finds it finite)
                    watch.on_step_to_judge()
            elif not self.reports.step_result(result, read_step_result(result)):
                watch.on_finite_step()
        finally:
            self.in_step, self._stepping, held, self.pending_overflow = False, None, self.pending_overflow, None
            self.skipped_in_a_row = 0
            watch.cycle.end_step(step)
            if held is not None:  # (a held loss the step ran after: not the scaler's overflow; none on most steps)
                watch.on_step_ran(held)

    def check_unchecked_of(self, parameter: torch.Tensor) -> bool:
        """A forward read ``parameter`` non-finite, and a state tensor of it is too: the check skipped after a bounded
        step holding it runs now and reports that step, which carried the state into it; True then. (Finite state:
        no bounded step made it, a forward's max-norm or a reload did; the forward's report stands.)"""
        for key, (opt, step) in list(self._unchecked.items()):
            if any(held is parameter for group in opt.param_groups for held in group["params"]) and (
                    held_state(opt, parameter) is not None):
                del self._unchecked[key]
                result = self._step_result(opt, step, True)
                return self.reports.step_result(result, read_step_result(result))
        return False

    def settle_last_good(self) -> None:
        """At the first real event: the last step's result, carried to the next check (deferred), is read now;
        finite, the state copied right after it is the last good one (an event found before that check)."""
        carried = self.carried
        if carried is not None and self.watch.last_good.where is not None and all(
                map(math.isfinite, read_scalars(carried.norms))):
            self.watch.last_good.promote()

    @property
    def steps(self) -> int:
        """Training iterations completed (iterations.py)."""
        return self.iterations.completed

    def absorb_steps(self, inner: OptimizerChecks) -> None:  # the steps a nested watch counted while it had taken over
        self.iterations.absorb(inner.iterations)

    def _step_result(self, opt: torch.optim.Optimizer, step: int, bounded: bool, read_now: bool = True
                     ) -> StepResult:
        """What ``opt``'s step ``step`` updated, with the norms that say whether it stayed finite (not read yet;
        ``read_now``: read at once by :func:`read_step_result`, not carried to the next check)."""
        layout = self.layout(opt)
        updated = [parameter for _name, parameter in layout.named]
        # State can overflow while its parameter stays finite (Adam's exp_avg_sq = inf freezes the update at 0):
        # half-precision state at every step, float32 state only after gradients of 1e18 or more (a square above
        # its max), whose step alone pays a pass over it.
        states = layout.half_state if not self._huge else [
            (name, parameter, key) for name, parameter in layout.named for key in opt.state.get(parameter, {})]
        for _name, parameter, key in states:
            value = opt.state.get(parameter, {}).get(key)
            updated.append(value if is_checkable(value) else _FINITE)
        # The launch-bound regime's parameters (Layout.one_sum), where they are read now (not carried): one sum
        # of their concatenation, not a norm each (a call per parameter, and a float each to read: 205 -> 67 us
        # on tiny_lm's 76, benchmarks/README.md fourteenth round). Non-finite exactly when one of them is, or
        # when huge finite values overflow it: either way they are then measured one by one, at once, as they
        # still are (read_step_result), and judged as before. (A carried result is read after the next forward.)
        summed = read_now and layout.one_sum and not states and not layout.generic
        values: list[torch.Tensor] | None = None
        if summed:
            try:
                with GradOff():
                    values = [_flatten(updated).sum()]
            except RuntimeError:  # parameters moved apart since the layout was built (``p.data = p.data.cuda()``)
                summed = False
        if values is None:
            values = norms(updated, finiteness_only=True)
        result = StepResult(opt, step, layout, updated, values, self._last_checked_step, bounded, states=states,
                            summed=summed)
        result.before, self._before = self._before, {}
        self._last_checked_step = step
        return result

    def flush(self) -> None:
        """At the end of the watch: a deferred step result still unread, and parameters no check has read.

        Bounded steps skip their parameter check (step_layout.py); a parameter
        written non-finite between steps by code outside the optimizer, and
        never read by a forward since, would otherwise leave the watch unseen.
        """
        carried, self.carried = self.carried, None
        if carried is not None and not self.reports.step_result(carried, read_step_result(carried), left=True):
            self.watch.last_good.promote()
        unchecked, self._unchecked = self._unchecked, {}
        for opt, step in unchecked.values():
            result = self._step_result(opt, step, True)
            if self.watch.outcome.stopped or self.reports.step_result(result, read_step_result(result)):
                return

    # -- GradScaler ------------------------------------------------------------------

    def scaler_active(self) -> bool:
        return any(scaler.is_enabled() for scaler in self.scalers)

    def scale(self) -> float | None:
        """The smallest scale of the enabled GradScalers (None without one)."""
        scales = [scaler.get_scale() for scaler in self.scalers if scaler.is_enabled()]
        return min(scales) if scales else None

    def on_scale(self, scaler: Any) -> None:
        """``scaler.scale(loss)`` ran (scaler_patch.py): the scaler is in use, passed to watch or not."""
        if self.watch.here.mine and not any(scaler is known for known in self.scalers):
            self.scalers.append(scaler)

    def before_scaler_step(self, scaler: Any, opt: torch.optim.Optimizer) -> int:
        return self.step_calls

    def after_scaler_step(self, scaler: Any, opt: torch.optim.Optimizer, step_calls: int) -> None:
        """``scaler.step(opt)`` returned: without an optimizer step call in between, it skipped the step."""
        if not self.watch.here.mine or not scaler.is_enabled() or self.step_calls != step_calls:
            return
        self.on_scale(scaler)
        if not holds(self.seen, opt):
            self.seen.append(opt)
        self.watch.cycle.step_skipped(opt)

    def hold_gradient_event(self, finding: Finding) -> bool:
        """Hold a backward event while a GradScaler may still skip the step."""
        if not self.scaler_active():
            return False
        if self.pending_overflow is None:
            self.pending_overflow = finding
        return True

    def on_step_boundary(self, skipped_by: torch.optim.Optimizer | None = None, leaving: bool = False) -> None:
        """A step ended after a backward but no optimizer step: was it skipped?

        With an enabled GradScaler that is the scaler skipping an overflowed
        step (``skipped_by``: the optimizer whose ``scaler.step`` was seen
        skipping). The held gradient event says where it overflowed; when
        only a parameter gradient overflowed (the activation gradients were
        finite), the parameter gradients, still in place, say which: read
        then, or as the watch is left (``leaving``) after a backward no step
        followed. A micro-step of gradient accumulation under a scaler (no
        ``scaler.step`` called yet) is no skip: the held event waits for the
        scaler's step, which says whether the accumulated gradients overflowed.
        """
        if self.scaler_active():
            # A skipped step, or a micro-step: the next backward's gradients are measured afresh ("Hot gradients").
            self._hot.clear()
            if skipped_by is None and not leaving:
                return
        finding, self.pending_overflow = self.pending_overflow, None
        if finding is None and self.scaler_active():
            optimizers = [skipped_by] if skipped_by is not None else self._optimizers()
            finding = check_parameter_grads(
                [(name, p) for opt in optimizers for name, p in self.named_parameters(opt)],
                Note("grads-overflowed"),
                self.watch.config.kinds,
            )
            if finding is not None:
                self.reports.attribute(finding)
        if finding is None:
            return
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        scale = min(scaler.get_scale() for scaler in self.scalers if scaler.is_enabled())
        finding.benign = True
        finding.notes.append(
            Note.of("scaler-skipped", in_a_row=self.skipped_in_a_row, total=self.skipped_total, scale=scale)
        )
        self.watch.emit(finding)
        if self.skipped_in_a_row >= COLLAPSE_SKIPS or scale < 1.0:
            finding.benign = False
            # Judged at the scaler's step (deferred too): %debug opens there, not at backward's line (events.py).
            finding.backward_caller = None
            finding.cause = Cause(
                "grad-scaler-collapse", "grad-scaler-collapse", (("skipped", self.skipped_in_a_row), ("scale", scale))
            )
            finding.notes.append(Note.of("scaler-collapsing", skips=COLLAPSE_SKIPS))
            self.watch.emit(finding)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.watch.targets.optimizers or self.seen)


#: Concatenates flattened tensors in one C++ call (what ``torch._utils._flatten_dense_tensors`` calls).
_flatten = torch._C._nn.flatten_dense_tensors

#: torch's inference-mode guard (what ``torch.inference_mode`` enters: a C++ guard, no Python frames).
_INFERENCE = torch._C._InferenceMode
#: Stands in for a state tensor that has gone (its check then passes).
_FINITE = torch.zeros(1)
#: A parameter group's ``lr`` object (a C callable: read each carried step with no Python call).
_GROUP_LR = operator.methodcaller("get", "lr")
