"""Loop code that writes a watched parameter between ``backward()`` and the next step: seen at that step.

A hand-written optimizer (SGD with momentum over ``model.parameters()``, no
``torch.optim``) or a hand-written update of one tensor beside an optimizer
(``w.sub_(lr * w.grad / counts)`` for a tied embedding) writes parameters in
the loop's own code. No optimizer hook sees it; without this, the next
forward meets the parameter already non-finite, a step late, and no op or
line can be named any more.

The *update region* runs from ``backward()`` returning to the next optimizer
step or top-level model call (or the watch's end). The tiered watch records
it as it records the loss code (outside/recorder.py, a recorder of its own, so the
loss code's records stay for the deferred check): at its end, the watched
parameters the recorded ops wrote in place are measured (one norm each, read
at once, or with the deferred check's single transfer), and a non-finite one
is reported as phase ``optimizer`` (the user's update code is the optimizer)
at the step it happened, its owning module as the module, and the recorded
ops, run again on copies under the op tracer, name the op and line that
made it. Ops mode traces that code anyway: its op tracer already knows which
op started a parameter's values (:meth:`OpTracer.origin_of`).

Cost: loop code that writes parameters only now and then (a renormalisation
every 100 steps, a decay applied while the loss is high) must be recorded at
the step it writes, which is not known in advance. A region is recorded
again while its last recording wrote a parameter or ran at most
:data:`CHEAP_REGION` ops (the usual ``opt.step()`` right after ``backward()``
runs none; a ``loss.item()`` to log runs one): pushing and popping the
recorder costs a few microseconds a step, and each op recorded about as much
again. A region that ran more ops and wrote no parameter (gradient clipping,
``scaler.unscale_``: tens of microseconds a step to record) is not recorded
again; a write there is reported by the next forward that reads the
parameter, a step late and without its op.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from nan_magic.hot.finding import Finding
from nan_magic.hot.stats import kinds_of, norms, relevant_kinds
from nan_magic.localize.ops.origins import OpFinding, attach_origin
from nan_magic.localize.ops.plans import plan_of, tensors
from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.localize.outside.recorder import KEEP_TOTAL, OutsideRecorder
from nan_magic.records import Phase, TensorRef

__all__ = ["CHEAP_REGION", "LoopWrites"]

#: An update region that wrote no watched parameter is recorded again if it ran at most this many ops
#: (a ``loss.item()`` or two to log; clipping runs eight foreach ops, which would cost tens of µs a step).
CHEAP_REGION = 4


class LoopWrites:
    """The update region of each step and the watched parameters its code wrote (see the module docstring).

    Parameters
    ----------
    kinds
        The watched kinds.
    named_parameters
        The watched models' parameters under their names.
    attribute
        Names the module owning the parameter in a finding's tensor.
    emit
        Records an event.
    step
        The step an event now belongs to.
    tracer
        Ops mode: gives its op tracer, made when the watch attaches. Without
        it (the tiered and full modes) the region is recorded.
    """

    def __init__(
        self,
        kinds: frozenset[str],
        named_parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        attribute: Callable[[Finding], None],
        emit: Callable[[Finding], None],
        step: Callable[[], int],
        tracer: Callable[[], OpTracer | None] | None = None,
    ) -> None:
        self._kinds = kinds
        self._named_parameters = named_parameters
        self._attribute = attribute
        self._emit = emit
        self._step = step
        self._tracer = tracer
        self._recorder = _UpdateRecorder(kinds, self._parameter_of) if tracer is None else None
        # Record the next update region: the first one, then while the last one wrote a parameter or was cheap.
        self._wanted = True
        # The written parameters whose norms the deferred check reads: (name, parameter, tensor written).
        self._pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._pending_step = 0
        # The watched parameters by id and by memory (_is_parameter), built when first needed.
        self._index: tuple[dict[int, tuple[str, torch.Tensor]],
                           dict[tuple[int, int], tuple[str, torch.Tensor]]] | None = None

    def begin(self) -> None:
        """``backward()`` returned: record the loop code until the next optimizer step or model call."""
        if self._recorder is not None and self._wanted:
            self._recorder.start("update")

    def end(self) -> list[torch.Tensor]:
        """The region ends: the norms (not read yet) of the watched parameters its code wrote.

        Ops mode reads nothing: a parameter its tracer saw an op make
        non-finite is reported now.
        """
        if self._tracer is not None:
            self._report_traced()
            return []
        recorder = self._recorder
        if recorder is None or not recorder.pushed:
            return []
        recorder.stop()
        count = recorder.recorded()
        if not count:  # the usual region (opt.step() right after backward()): nothing to look at or let go
            self._pending, self._wanted = [], count <= CHEAP_REGION and "update" not in recorder.untraced
            return []
        # Most regions write only gradients (clipping): the cached index rules them out without a walk of
        # the parameters; a region that wrote one is looked up afresh (a parameter may have been replaced).
        written = [tensor for tensor in recorder.written() if self._parameter_of(tensor) is not None]
        self._pending = self._watched(written) if written else []
        self._wanted = (bool(self._pending) or count <= CHEAP_REGION) and "update" not in recorder.untraced
        if not self._pending:
            recorder.forget()
            return []
        self._pending_step = self._step()
        return norms([parameter for _name, parameter, _written in self._pending])

    def judge(self, values: list[float]) -> None:
        """Report the first written parameter whose norm (``values``, in :meth:`end`'s order) is not finite."""
        pending, self._pending = self._pending, []
        recorder = self._recorder
        try:
            for (name, parameter, written), value in zip(pending, values):
                if math.isfinite(value):
                    continue
                if not relevant_kinds(kinds_of(parameter), self._kinds):
                    continue
                finding = self._finding(name, parameter)
                if recorder is not None:
                    origin = recorder.claim(written)
                    if origin is not None:
                        _tensors, frame, position = recorder.witness(origin)
                        self._attach(finding, origin)
                        finding.frame, finding.frame_position = frame, position
                self._emit(finding)
                return
        finally:
            if recorder is not None:
                recorder.forget()

    def pause(self) -> None:
        """A part of the run ends (a ``%nanwatch on`` cell): stop recording until :meth:`resume`, keep the records."""
        if self._recorder is not None:
            self._recorder.pause()

    def resume(self) -> None:
        """The next part begins: record on where the last part stopped inside the update region."""
        if self._recorder is not None:
            self._recorder.resume()

    def forget(self) -> None:
        """The watch ends: stop recording and drop what was recorded."""
        self._pending, self._index = [], None
        if self._recorder is not None:
            self._recorder.stop()
            self._recorder.forget()

    # -- helpers ------------------------------------------------------------------------

    def _parameter_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The watched parameter ``tensor`` is (or is on the memory of, as ``.data``), or None.

        Asked at every in-place op of the region (clipping's ``_foreach_mul_`` writes every gradient): the
        parameters are indexed once, again whenever a region wrote one (:meth:`_watched`).
        """
        if self._index is None:
            self._index = self._indexed()
        by_id, by_memory = self._index
        entry = by_id.get(id(tensor))
        if entry is None and tensor.layout is torch.strided:
            entry = by_memory.get(_memory(tensor))
        return entry[1] if entry is not None else None

    def _indexed(self) -> tuple[dict[int, tuple[str, torch.Tensor]], dict[tuple[int, int], tuple[str, torch.Tensor]]]:
        by_id: dict[int, tuple[str, torch.Tensor]] = {}
        by_memory: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}
        for name, parameter in self._named_parameters():
            if not parameter.is_floating_point():
                continue
            by_id.setdefault(id(parameter), (name, parameter))
            if parameter.layout is torch.strided:
                by_memory.setdefault(_memory(parameter), (name, parameter))
        return by_id, by_memory

    def _watched(self, written: list[torch.Tensor]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """The written tensors that are watched parameters (or their ``.data``), with their names."""
        by_id, by_memory = self._index = self._indexed()
        found = []
        for tensor in written:
            entry = by_id.get(id(tensor))
            if entry is None and tensor.layout is torch.strided:
                entry = by_memory.get(_memory(tensor))  # ``p.data.sub_(...)``: another object on its memory
            if entry is not None:
                found.append((entry[0], entry[1], tensor))
        return found

    def _finding(self, name: str, parameter: torch.Tensor) -> Finding:
        step = self._pending_step if self._tracer is None else self._step()
        finding = Finding(Phase.OPTIMIZER, None, TensorRef.parameter(name), bad=parameter.detach(), step=step)
        self._attribute(finding)
        finding.notes.append(
            f"the loop's own code wrote {name} between backward() and the next step (a hand-written update)"
        )
        return finding

    @staticmethod
    def _attach(finding: Finding, origin: OpFinding) -> None:
        attach_origin(finding, origin)
        finding.phase = Phase.OPTIMIZER  # the user's update code is the optimizer

    def _report_traced(self) -> None:
        """Ops mode: a watched parameter whose values an op of the loop code started is reported now."""
        tracer = self._tracer() if self._tracer is not None else None
        if tracer is None or tracer.finding is not None or not tracer.started:
            return  # a healthy step started no origin: no parameter to look up
        for name, parameter in self._named_parameters():
            origin = tracer.origin_of(parameter)
            if not isinstance(origin, OpFinding) or origin.phase == Phase.BACKWARD:
                continue
            finding = self._finding(name, parameter)
            tracer.claim(parameter)
            self._attach(finding, origin)
            finding.frame, finding.frame_position = tracer.frame_of(origin)
            self._emit(finding)
            return


def _memory(tensor: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's values start: a parameter and its ``.data`` share it."""
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset())


class _UpdateRecorder(OutsideRecorder):
    """The update region's recorder: a watched parameter is copied before the region first writes it in place.

    The producer may be that write itself (``w.div_(w.norm())``): a replay
    must start from the value it divided, not the one it left. The copy is
    kept under the parameter and under the tensor written (``p.data``), where
    that is not a recorded op's output (``p.detach()``, which the replay makes
    again from the parameter's copy). Up to
    :data:`~nan_magic.localize.outside.recorder.KEEP_TOTAL` bytes a region; only a
    loop that writes parameters pays for it.
    """

    def __init__(self, kinds: frozenset[str], parameter_of: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        super().__init__(kinds)
        self._parameter_of = parameter_of
        self._copied = 0

    def forget(self, last: bool = False) -> None:
        super().forget(last)
        self._copied = 0

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.recording() and isinstance(func, torch._ops.OpOverload):
            plan = plan_of(func)
            if plan.writes:
                for _label, tensor in tensors(plan, args, kwargs or {}, plan.writes):
                    self._copy(tensor)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _copy(self, tensor: torch.Tensor) -> None:
        parameter = self._parameter_of(tensor)
        if parameter is None:
            return
        for kept in (parameter, tensor) if parameter is not tensor and not self.made(tensor) else (parameter,):
            size = kept.numel() * kept.element_size()
            if id(kept) not in self.before and self._copied + size <= KEEP_TOTAL:
                self.before[id(kept)] = kept.detach().clone()
                self._copied += size
