"""Loop code that writes a watched parameter between ``backward()`` and the next step: seen at that step.

A hand-written optimizer (SGD with momentum over ``model.parameters()``, no ``torch.optim``) or a hand-written update
of one tensor beside an optimizer (``w.sub_(lr * w.grad / counts)`` for a tied embedding) writes parameters in the
loop's own code. No optimizer hook sees it; without this, the next forward meets the parameter already non-finite, a
step late, and no op or line can be named any more.

The *update region* runs from ``backward()`` returning to the next optimizer step or top-level model call (or the
watch's end). The tiered watch records it as it records the loss code (outside/recorder.py, a recorder of its own, so
the loss code's records stay for the deferred check): at its end, the watched parameters the recorded ops wrote in
place are measured (one norm each, read at once, or with the deferred check's single transfer), and a non-finite one
is reported as phase ``optimizer`` (the user's update code is the optimizer) at the step it happened, its owning
module as the module, and the recorded ops, run again on copies under the op tracer, name the op and line that made
it. The *data region* (the optimizer step to the next model call, recorded by the main recorder) is watched for the
same writes (a max-norm renorm after ``opt.step()``, weight clipping, an EMA teacher's ``t.mul_(m)``):
param_writes.py's DataWrites copies a parameter before the region writes it in place, and :meth:`LoopWrites.end`
judges it with the update code's, as the region ends. Ops mode traces that code anyway: its op tracer already knows
which op started a parameter's values (:meth:`OpTracer.origin_of`).

Cost: loop code that writes parameters only now and then (a renormalisation every 100 steps, a decay applied while the
loss is high) must be seen at the step it writes, which is not known in advance. A region is recorded in full while
its last recording wrote a parameter or ran at most :data:`CHEAP_REGION` ops (the usual ``opt.step()`` right after
``backward()`` runs none; a ``loss.item()`` to log runs one): pushing and popping the recorder costs a few
microseconds a step, and each op recorded about as much again. A region that ran more ops and wrote no parameter
(gradient clipping, ``scaler.unscale_``, a scheduler) is *watched* instead: each op only passes through (its plan
looked up, the op and its caller's frame kept in a ring of the last :data:`RING` ops, nothing copied or read), until
an op writes a watched parameter in place; from that op on the region is recorded, the ring first, so the write and
the ops just before it that made its operand (``w.sub_(lr * w.grad / counts)``) are replayed at the step it happened.
A kept op that a library function ran (``F.normalize``'s) has no line: finding the user's line above it at every op
would cost more than the watching.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.reads import norms, relevant_kinds
from nan_magic.hot.stats import kinds_of
from nan_magic.localize.ops.origins import OpFinding, apply_op_finding, attach_origin
from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.localize.outside.assigned import assigned_gradient, claim_assigned
from nan_magic.localize.outside.lr_lines import name_lr
from nan_magic.localize.outside.param_writes import (
    DataWrites,
    Index,
    Rebound,
    Storages,
    data_ptr,
    has_own_memory,
    lookup,
)
from nan_magic.localize.outside.recorded_ops import copied_nonfinite
from nan_magic.localize.outside.recorder import OutsideRecorder
from nan_magic.localize.outside.region_records import RegionRecords
from nan_magic.localize.outside.update_recorder import RING, UpdateRecorder
from nan_magic.records import Note, Phase, TensorRef

__all__ = ["CHEAP_REGION", "RING", "LoopWrites"]


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
    data
        The main recorder (outside/recorder.py), whose data region (the
        optimizer step to the next model call) is watched for parameter
        writes too: a max-norm renorm after ``opt.step()`` is judged with
        the update code's writes, at the region's end, and named by the write.
    """

    def __init__(
        self,
        kinds: frozenset[str],
        named_parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        attribute: Callable[[Finding], None],
        emit: Callable[[Finding], None],
        step: Callable[[], int],
        tracer: Callable[[], OpTracer | None] | None = None,
        data: OutsideRecorder | None = None,
    ) -> None:
        self._kinds = kinds
        self._named_parameters = named_parameters
        self._attribute = attribute
        self._emit = emit
        self._step = step
        self._tracer = tracer
        self._recorder = UpdateRecorder(kinds, self._parameter_of, self._storages) if tracer is None else None
        #: The update region's recorder (None in ops mode, where the op tracer sees every op).
        self.recorder: OutsideRecorder | None = self._recorder
        # Record the next update region in full: the first one, then while the last one wrote a parameter or
        # was cheap; otherwise it is watched (the module docstring).
        self._wanted = True
        # The written parameters whose norms the deferred check reads: (name, parameter, tensor written, the
        # records that name the write: the update recorder's or the data region's).
        self._pending: list[tuple[str, torch.Tensor, torch.Tensor, RegionRecords]] = []
        self._pending_step = 0
        # The watched parameters by id and by storage (_parameter_of), built when first needed.
        self._index: Index | None = None
        #: The data region's parameter writes, noted by the main recorder as it records them.
        self.data: DataWrites | None = None
        self._data_recorder = data if tracer is None else None
        if data is not None and tracer is None:
            self.data = DataWrites(data, self._cached_index)
            data.on_write = self.data.on_write
        self._rebound = Rebound(self._cached_index, self._fresh_index)  # ``param.data = v`` (param_writes.py)
        #: Watched parameters the loop replaced by new ones (``m.bias = nn.Parameter(v)``), each with an alias of its
        #: memory then (a ``.data = ...`` since rebinds it): :meth:`on_registered`.
        self._replaced: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._update_rebound = Rebound(self._cached_index, self._fresh_index)  # the same, in the update region

    def on_registered(self, module: nn.Module, name: str, parameter: torch.Tensor | None) -> None:
        """torch's parameter registration hook: ``module.name = nn.Parameter(v)``, noted where it replaces a watched,
        finite parameter (a module built in the loop registers names it never had; a frozen inf sentinel the watch
        met as it was, renewed, is no event). No optimizer steps the new one and, until a forward reads it, no check
        sees it; the old keeps its memory (Rebound misses it). Judged with the data region's writes as that region
        ends (:meth:`end`), named by the op that made its memory. At a registration only (one read of the old one).
        """
        old = module._parameters.get(name)
        if (parameter is not None and old is not None and self._data_recorder is not None
                and parameter.is_floating_point() and id(old) in self._cached_index()[0]  # (meta: no values)
                and (old.is_meta or old.layout is not torch.strided or bool(torch.isfinite(old).all()))):
            self._replaced.append((parameter, parameter.detach()))

    def _replacements(self, main: RegionRecords) -> list[tuple[str, torch.Tensor, torch.Tensor, RegionRecords]]:
        """The watched parameters that replaced others since the last region's end (:meth:`on_registered`)."""
        replaced, self._replaced = self._replaced, []
        by_id = self._fresh_index()[0]  # (the new ones under their names)
        self._rebound.forget()  # (its parameters are learned again: the new ones among them)
        found = []
        for parameter, alias in replaced:
            if (entry := by_id.get(id(parameter))) is not None and entry[1] is parameter:
                if has_own_memory(parameter) and parameter.data_ptr() != alias.data_ptr():
                    # Rebound since (``p.data = p.data / p.data.norm()`` after the registration): the region's ops
                    # read its memory then, the alias's, which a replay must start from (as Rebound.moved's).
                    main.before.setdefault(id(parameter), alias)
                found.append((entry[0], parameter, made if (made := main.made_on(parameter)) is not None else parameter,
                              main))
        return found

    def begin(self) -> None:
        """``backward()`` returned: record the loop code until the next optimizer step or model call."""
        if self._recorder is not None:
            if self._update_rebound.seen is None:  # (once: each parameter's memory, for end() to see it rebound)
                self._update_rebound.moved(self._recorder)
                if self._rebound.seen is None and (main := self._data_recorder) is not None:
                    # The data region's too: learned at its first recorded end, it missed a rebinding there when
                    # that region was the first to run an op (``p.data = torch.full(..., nan)`` after the step,
                    # found at the next full check, steps later; the usual data region, ``zero_grad()``, runs none).
                    self._rebound.moved(main)
            if self._wanted:
                self._recorder.start("update")
            else:
                self._recorder.watch()

    def loss_starts(self) -> list[torch.Tensor]:
        """``backward()`` starts while the update region is recorded: that region's code was a loss's (the second of
        a step: ``l1.backward(retain_graph=True); l2 = aux(out); l2.backward()``, an auxiliary loss with its own
        backward, two accumulated losses). Its records go on in the main recorder's loss region, where the loss and
        gradient checks of that backward look (a watched region's last ops too), and the region ends as at a model
        call: :meth:`end`'s norms of what it wrote. No call on the usual step (its update region follows backward)."""
        recorder, main = self._recorder, self._data_recorder
        if recorder is None or not recorder.pushed:
            return []
        if recorder.watching:  # (its last ops, in the ring: the loss code's, as far as they go back)
            recorder.watching = False
            recorder._record_ring()
        if main is not None and main._region == "loss" and "loss" not in main.untraced and recorder._n_ops:
            main.adopt(recorder)
            main._held_bytes += recorder._held_bytes
        written = self.end()
        # (The region is recorded again next step, as loss code: watched, its first ops would fall out of the ring.)
        self._wanted = "update" not in recorder.untraced
        return written

    def end(self, step: int | None = None) -> list[torch.Tensor]:
        """A region ends: the norms (not read yet) of the watched parameters its code wrote, and of those still
        pending (the deferred check reads them all in one transfer). ``step``: the step they are reported at, where
        not the current one (an optimizer's step hooks' writes, judged as the step that ran them returns).

        Called as the update region ends (an optimizer step, a model call, the
        watch's end) and so as the data region ends too (a model call, the
        watch's end): the data code's writes come first, as they ran first
        where both regions end together (a data region ends at a model call).
        Ops mode reads nothing: a parameter its tracer saw an op make
        non-finite is reported now.
        """
        if self._tracer is not None:
            self._report_traced(step)
            return []
        # (Asked at every model call and optimizer step: the usual answer, nothing written, costs no call.)
        data = self.data
        found = self._data_written() if data is not None and data.written else []
        # A recorded data region after a step ends: what it rebound (``param.data = v``) is judged as written (Rebound;
        # not the watch's entry, which may build the model). Fields read, pointers compared in C: no call a step.
        if ((main := self._data_recorder) is not None and main._ops and main._region == "data" and not main._entry
                and ((seen := (rebound := self._rebound).seen) is None or list(map(data_ptr, seen[1])) != seen[2])):
            found += [(name, parameter, made, main) for name, parameter, made in rebound.moved(main)]
        if self._replaced and main is not None:  # (a field read a step: a parameter replaced, now and then)
            found += self._replacements(main)
        recorder = self._recorder
        if recorder is not None and recorder.pushed:
            wrote = not recorder.watching  # a watched region is recorded from its first parameter write on
            # What its recorded ops made a parameter's new memory (``vector_to_parameters`` after backward, a loop
            # that steps with no optimizer): judged as written there. (A parameter rebound elsewhere, a data region's
            # ``p.data = v`` after a step, is that region's: its memory is no output of these ops.)
            remade = [(name, parameter, made) for name, parameter, made in self._update_rebound.moved(recorder)
                      if made is not parameter] if (
                wrote and recorder._n_ops and (seen := self._update_rebound.seen) is not None
                and list(map(data_ptr, seen[1])) != seen[2]) else []
            recorder.stop()
            recorder.watching = False
            if remade:
                self._wanted = "update" not in recorder.untraced
                found += [(name, parameter, made, recorder) for name, parameter, made in remade]
            elif not wrote:
                self._hold(recorder)
            elif not (count := recorder._n_ops):  # (recorded(), read directly: every step)
                # The usual region (opt.step() right after backward()): nothing to look at or let go.
                self._wanted = "update" not in recorder.untraced
            else:
                found += self._update_written(recorder, count)
        if not found:
            return []
        if not self._pending:
            self._pending_step = self._step() if step is None else step
        self._pending += found
        return norms([parameter for _name, parameter, _written, _records in self._pending])

    def _data_written(self) -> list[tuple[str, torch.Tensor, torch.Tensor, RegionRecords]]:
        """The watched parameters the data region's code wrote since it was last asked."""
        assert self.data is not None
        # (Named as found when written: the index is not built afresh every step an EMA teacher is updated.)
        return [(name, parameter, tensor, self.data.records) for tensor, name, parameter in self.data.take()]

    def _update_written(self, recorder: UpdateRecorder, count: int
                        ) -> list[tuple[str, torch.Tensor, torch.Tensor, RegionRecords]]:
        """The update region (``recorder``'s, ``count`` ops recorded) ended: the watched parameters its code wrote."""
        # Most regions write only gradients (clipping): the cached index rules them out without a walk of
        # the parameters; a region that wrote one is looked up afresh (a parameter may have been replaced).
        written = [tensor for tensor in recorder.written() if self._parameter_of(tensor) is not None]
        found = self._watched(written) if written else []
        # (A region that assigned a gradient, ``p.grad = total / count``, is recorded every step too: watched, its ring
        # would drop the first gradients' ops. Asked as a recorded region that wrote no parameter ends: not again once
        # it is watched.)
        self._wanted = (bool(found) or count <= CHEAP_REGION or assigned_gradient(
            recorder._ops, recorder._produced, self._cached_index()[0].values())) and "update" not in recorder.untraced
        if not found:
            self._hold(recorder)
        return [(name, parameter, tensor, recorder) for name, parameter, tensor in found]

    def _hold(self, recorder: UpdateRecorder) -> None:
        """The region ended writing no parameter: its records (a watched one's last ops) stay until the step's check
        has judged the gradients it may have written (:meth:`claim_gradient`): the main recorder's next forget."""
        if (main := self._data_recorder) is not None:
            main.then_forget, main._clean = recorder, False  # (its forget runs then, if nothing else is to go)
        else:
            recorder.forget()

    def claim_gradient(self, gradient: torch.Tensor) -> OpFinding | None:
        """The op of the update region (held by :meth:`_hold`) that made a gradient non-finite, or None.

        The gradients are judged at the optimizer step, after the update code (``p.grad.div_(p.grad.norm())``, a
        clip by hand): its records, run again from what they read (a gradient its write divided by a value made
        from it was copied before the write: update_recorder.py), name the op and line that made it.
        """
        recorder = self._recorder
        if recorder is None:
            return None
        if recorder._ring:
            recorder._record_ring()
        found = recorder.claim(gradient, written=True)  # (or a number the code wrote in, ``g[0, 0] = inf``: its lift)
        # (Not found by the tensor itself: a write through ``.data``, a foreach op's: by its memory.)
        return found if found is not None else recorder.claim_written(gradient)

    def name_lr(self, finding: Finding, lr: float, raw: object = None) -> bool:
        """An optimizer step made ``finding``'s parameter non-finite with a non-finite learning rate ``lr``: name the
        op of the loop's update code that made it, if one did; True when one was named.

        A rate the loop computes each step (a Polyak step size ``(f - f*) / |g|^2``, ``0 / 0`` on a batch with no
        labelled sample) reaches ``param_groups`` as a Python number through ``.item()``, which ties it to no
        tensor: the latest one-element tensor the update region made holding that same non-finite number is taken
        for its source, and the op that started it (its records run again; ops mode: the tracer's origins) is the
        report's, at its line. Where no op made it (a number computed in Python, a tensor rate made before the
        records kept: ``raw`` is the group's own ``lr``), the loop's line that set it (lr_lines.py). Asked at such
        an event only.
        """
        tracer = self._tracer() if self._tracer is not None else None
        return name_lr(finding, lr, raw, tracer, self._recorder)

    def claim_assigned(self, name: str, parameter: torch.Tensor) -> Finding | None:
        """A forward read ``parameter`` non-finite, and no write the watch followed made it: the finding of the loop's
        code that assigned it (``vector_to_parameters(theta, params)``, no optimizer and no backward: a loss region),
        named by the recorded op that made its memory (assigned.py); else None. At that event only."""
        for records in (self._data_recorder, self._recorder):
            if (origin := claim_assigned(records, parameter)) is not None and records is not None:
                finding = self._finding(name, parameter, step=self._step(), origin=origin)
                _tensors, finding.frame, finding.frame_position = records.witness(origin)
                finding.frame_calls = records.calls_to(finding.frame)
                return finding
        return None

    def judge(self, values: list[float]) -> None:
        """Report the first written parameter whose norm (``values``, of the first pending in :meth:`end`'s order:
        the deferred check judges the code that ran before the step's calls first) is not finite."""
        pending, self._pending = self._pending[:len(values)], self._pending[len(values):]
        try:
            for (name, parameter, written, records), value in zip(pending, values):
                if math.isfinite(value):
                    continue
                if not relevant_kinds(kinds_of(parameter), self._kinds):
                    continue
                # (``written=True``: where no op made its value, the lift of a number the code wrote into it, ``w[0, 0]
                # = nan``. Else the op that made the memory it was assigned since: a write first followed, ``w[3] =
                # 0``, then ``w.data = w.data / norm`` in a helper, which no replay of that write's ops makes.)
                origin = records.claim(written, written=True) or claim_assigned(records, parameter)
                if origin is None and _copied(records, written):
                    continue  # copied from a state already non-finite: the next forward's check names it, as ops=True
                finding = self._finding(name, parameter, after_step=records is not self._recorder, origin=origin)
                if origin is not None:
                    _tensors, frame, position = records.witness(origin)
                    finding.frame, finding.frame_position = frame, position
                    finding.frame_calls = records.calls_to(frame)
                    if records.frame_note is not None:  # %debug opens where the step was judged, or a later pass
                        finding.notes.append(records.frame_note)
                self._emit(finding)
                return
        finally:
            if self._recorder is not None and not self._pending:
                self._recorder.forget()

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
        self._pending, self._index, self._replaced = [], None, []
        self._rebound.forget()
        self._update_rebound.forget()
        if self.data is not None:
            self.data.take()
        if self._recorder is not None:
            self._recorder.stop()
            self._recorder.watching = False
            self._recorder.forget()

    # -- helpers ------------------------------------------------------------------------

    def parameters_before(self) -> dict[int, torch.Tensor]:
        """``{id(parameter): its value before the current update region first wrote it in place}``.

        What the step's last model call read where the loop has written its parameters back since: SAM restores
        ``w`` by ``p.sub_(e)`` after its second backward, before the step that the deferred check waits for. Empty
        in ops mode (the op tracer judged every op as it ran) and where the region wrote no parameter.
        """
        recorder = self._recorder
        if recorder is None or not recorder.before:
            return {}
        by_id = self._cached_index()[0]
        return {key: copy for key, copy in recorder.before.items() if key in by_id}

    def values_before(self) -> dict[int, tuple[torch.Tensor, int]]:
        """What the current update region's code wrote in place that is no parameter, as it was before, with its
        version then (UpdateRecorder.values_before); empty in ops mode. At an event only."""
        return self._recorder.values_before() if self._recorder is not None else {}

    def _parameter_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The watched parameter ``tensor`` is, or is on the memory of (``p.data``, a row ``p[3]``), or None.

        Asked at every in-place op of the region (clipping's ``_foreach_mul_`` writes every gradient): the
        parameters are indexed once, again whenever a region wrote one (:meth:`_watched`).
        """
        if self._index is None:
            self._index = self._indexed()
        entry = lookup(self._index, tensor)
        return entry[1] if entry is not None else None

    def _cached_index(self) -> Index:
        """The watched parameters by id and by storage, built when first needed (as :meth:`_parameter_of`'s)."""
        if self._index is None:
            self._index = self._indexed()
        return self._index

    def _fresh_index(self) -> Index:
        self._index = self._indexed()
        return self._index

    def _storages(self) -> Storages:
        """The storages of the watched parameters (``data_ptr()``): a tensor on another one is none of them."""
        if self._index is None:
            self._index = self._indexed()
        return self._index[1]

    def _indexed(self) -> Index:
        by_id: dict[int, tuple[str, torch.Tensor]] = {}
        by_storage: dict[int, list[tuple[int, int, str, torch.Tensor]]] = {}
        for name, parameter in self._named_parameters():
            if not parameter.is_floating_point() or id(parameter) in by_id or not isinstance(parameter, nn.Parameter):
                continue  # (a tensor functional_call swapped in for a parameter is the loop's own: swapped.py)
            by_id[id(parameter)] = (name, parameter)
            if has_own_memory(parameter):
                first = parameter.data_ptr()
                by_storage.setdefault(parameter.untyped_storage().data_ptr(), []).append(
                    (first, first + parameter.numel() * parameter.element_size(), name, parameter))
        return by_id, by_storage

    def _watched(self, written: list[torch.Tensor]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """The written tensors that are watched parameters (or on their memory), with their names."""
        index = self._index = self._indexed()
        found = []
        for tensor in written:
            entry = lookup(index, tensor)
            if entry is not None:
                found.append((entry[0], entry[1], tensor))
        return found

    def _finding(self, name: str, parameter: torch.Tensor, after_step: bool = False, step: int | None = None,
                 origin: OpFinding | None = None) -> Finding:
        """The finding of a parameter the loop's code wrote, with ``origin``, the op that started it, where known."""
        step = step if step is not None else self._pending_step if self._tracer is None else self._step()
        finding = Finding(Phase.OPTIMIZER, None, TensorRef.parameter(name), bad=parameter.detach(), step=step)
        self._attribute(finding)
        # The report keeps the parameter's counts; the op's own, the cause's, go on the note: it may have run lines
        # before the write (an EMA's `1.0 / count` made 1 inf, the teacher's weight then 48 NaN).
        counts = {"nan": origin.nan, "posinf": origin.posinf, "neginf": origin.neginf} if origin is not None else {}
        finding.notes.append(Note.of("loop-wrote-after-step" if after_step else "loop-wrote", name=name, **counts))
        if origin is not None:
            attach_origin(finding, origin)
            finding.phase = Phase.OPTIMIZER  # the user's update code is the optimizer
        return finding

    def _report_traced(self, step: int | None = None) -> None:
        """Ops mode: a watched parameter whose values an op of the loop code started is reported now (at ``step``,
        where given: :meth:`end`)."""
        tracer = self._tracer() if self._tracer is not None else None
        if tracer is None or tracer.finding is not None or not (tracer.started or tracer.literals):
            return  # a healthy step started no origin and lifted no non-finite number: no parameter to look up
        for name, parameter in self._named_parameters():
            if not isinstance(parameter, nn.Parameter):
                continue  # functional_call's stand-in (MAML's fast weights): the loop made it, wrote no parameter
            origin = tracer.origin_of(parameter) or tracer.written_into(parameter, take=False)  # (w[0, 0] = nan)
            # (An optimizer's step made it: its check reports it. One the loop wrote finite again since, a Parameter
            # of ``torch.empty`` filled before its first use, is no event: one read, of a started one only.)
            if (not isinstance(origin, OpFinding) or origin.phase in (Phase.BACKWARD, Phase.OPTIMIZER)
                    or bool(torch.isfinite(parameter).all())):
                continue
            _ = tracer.claim(parameter) or tracer.written_into(parameter)  # (a lifted number's finding: the tracer's)
            if origin.phase is Phase.FORWARD and origin.module is not None:
                # A module's own forward wrote it in place (a max-norm constraint under no_grad), found here by the
                # deferred check: the forward is the producer, as the immediate tracer names it at the op.
                finding = Finding(Phase.FORWARD, None, TensorRef.parameter(name), bad=parameter.detach(),
                                  step=self._step() if step is None else step)
                self._attribute(finding)
                # The report describes the op's output, the parameter beside it, as the tracer's at the op does.
                apply_op_finding(finding, origin)
            else:
                finding = self._finding(name, parameter, step=step, origin=origin)
            finding.frame, finding.frame_position = tracer.frame_of(origin)
            self._emit(finding)
            return


def _copied(records: RegionRecords, written: torch.Tensor) -> bool:
    """Whether the records :meth:`RegionRecords.claim` looks in (the region's, and the data code's it holds for the
    deferred check) show ``written`` last written by a copy of an already non-finite value (``copied_nonfinite``)."""
    held = [records._data[0] if records._data is not None else None,
            records._data_head[0][0] if records._data_head is not None else None,
            records._data_prior[0][0] if records._data_prior is not None else None]
    return any(copied_nonfinite(ops, written) for ops in (records._ops, *held) if ops)
