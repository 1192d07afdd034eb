"""The code between the watched models' calls (the loss, data code in the loop): recorded, replayed at an event.

The tiered watch replays a failing model call to name its op (replay/tiered/step.py),
but code outside every watched module is not a call it can run again: the
loss, a normalisation of the batch inside the loop, an advantage computed from
rewards. So that code's ops are *recorded* while it runs: a dispatch mode is
pushed when a top-level model call returns and popped when the next one
starts, when ``backward()`` starts and when an optimizer steps (the model's
own forward and backward, and the optimizer, are never recorded: their ops are
many). A record is the op, its arguments and outputs (references, no copies)
and the user's line that ran it; nothing is read. When the loss (or a batch
built in the loop) holds a non-finite value, :meth:`OutsideRecorder.claim`
runs the recorded ops that led to it again, on copies of what they read from
outside, under the op tracer: its first origin is the producer, named at the
recorded line. When the gradient flowing from the loss code into a model's
output is non-finite, :meth:`OutsideRecorder.claim_backward` runs them again
with gradients, then their backward: the op tracer names the backward op and
its autograd node, and the record the forward line that created that node.

Recording costs a few microseconds per op and reads nothing (no host sync on
CUDA). The references keep the loss code's values alive until ``backward()``
starts and the loss is judged; then small tensors stay (:data:`KEEP_BYTES`
each, :data:`KEEP_TOTAL` in all), large ones (logits) only weakly, until that
backward ends or, deferred, until the optimizer step has judged the step. A
data region's go when the next call has judged its batch (deferred: when the
next data region starts, :meth:`OutsideRecorder.batch_entered`).

Budgets: :data:`DATA_BUDGET` ops a step after an optimizer step (a
``DataLoader`` fetch runs a hundred or more), :data:`LOSS_BUDGET` after a model
call; a step over one turns that region off for the rest of the watch (the
data region is tried once more with DataLoader fetches stepped aside), and
reports say so. The code from the watch's entry to its first model call is a
data region within the same budget, left unrecorded alone when over it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nan_magic.hot.kept.generators import with_user_generator
from nan_magic.hot.kept.lines import LINES, line_at
from nan_magic.hot.kept.rng import capture_rng_state
from nan_magic.localize.ops.plans import Plan, run_rewrapped
from nan_magic.localize.ops.sources import GENERATED, PASSED_OVER, passed_over
from nan_magic.localize.outside.dispatch_stack import _INERT, OnTheDispatchStack, _inference
from nan_magic.localize.outside.generated import generated_line
from nan_magic.localize.outside.held import (
    KEEP_BYTES,
    KEEP_TOTAL,
    bytes_held,
    held_bytes,
    returned_let_go,
    weakened,
)
from nan_magic.localize.outside.op_entries import PASS, SEEDED_OP, ZERO_GRAD_CODES, op_entry, passes
from nan_magic.localize.outside.recorded_ops import RecordedOp, detached_from_model
from nan_magic.localize.outside.region_records import RegionRecords
from nan_magic.records import Note

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nan_magic.localize.ops.origins import OpFinding

__all__ = ["DATA_BUDGET", "LOSS_BUDGET", "UPDATE_BUDGET", "OutsideRecorder", "passes"]

#: Ops a step recorded in the code between an optimizer step and the next model call.
DATA_BUDGET = 64
#: Ops a step recorded between a model call's return and ``backward()`` (the loss, and metrics).
LOSS_BUDGET = 512
#: A loss region goes on across another model call of its step while it holds at most this many ops (start).
GOES_ON_MAX = LOSS_BUDGET // 4
#: Ops a step recorded between ``backward()`` and the next optimizer step or model call (outside/loop_writes.py).
UPDATE_BUDGET = 256


class OutsideRecorder(OnTheDispatchStack, RegionRecords, TorchDispatchMode):
    """Records the ops of the code outside the watched models, switched on and off at their boundaries.

    The records, and the replays an event runs of them, are :class:`RegionRecords`'s (region_records.py); its
    place on torch's dispatch-mode stack (pushed, popped, stepped aside) is :class:`OnTheDispatchStack`'s
    (dispatch_stack.py).
    """

    # Pushed and popped with torch's _push_mode/_pop_mode, not ``with``: three regions a step, and __enter__/__exit__
    # cost about 25 Python calls a pair more, for flags that change nothing for this mode: they tell torch.compile
    # whether a mode that does not ignore compile internals is active (this one does: ignore_compile_internals),
    # and Inductor whether to route a compiled region through a higher-order op this mode would have to handle.

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No ``torch._disable_dynamo`` wrapper around :meth:`__torch_dispatch__` (eight Python calls an op): it keeps
        Dynamo from tracing the mode's own frames, and this mode is never active while Dynamo traces
        (:meth:`ignore_compile_internals`; pushed only onto an empty dispatch stack), and calls only the op given."""
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """A ``torch.compile``d loss or step compiles as unwatched (its fused ops are not recorded).

        Dynamo declines to compile while any other dispatch mode is active.
        """
        return True

    def __init__(self, kinds: frozenset[str], keep_last: bool = False, stepped: bool = False,
                 holds_data: bool = False) -> None:
        TorchDispatchMode.__init__(self)
        RegionRecords.__init__(self, kinds)
        #: Whether a data region's records are held past the loss region of the model call that ends it (not only
        #: through it), until the next data region starts: the deferred check judges the batch at the optimizer step.
        self.holds_data = holds_data
        #: Whether :meth:`forget` keeps the last step's loss code (``keep_last_good``: see :meth:`loss_code`).
        self.keep_last = keep_last
        #: Whether an optimizer step follows backward: the default mode's gradient check runs there, and a fix
        #: trial at it runs the step's loss code, which :meth:`forget` then holds as recorded until that step.
        self.stepped = stepped
        self._raw = self.pushed = self._resumes = self._entry = False
        self._budget, self._region = 0, "loss"
        # Whether the watch was entered (or resumed) in inference mode: pushed and popped only where it is as the
        # watch found it, or as an inference_mode block entered since set it (as_blocks_set).
        self._watch_inferring = _inference()
        #: Whether the user's dispatch modes were on the stack as the watch attached: never pushed while it is
        #: attached (lifecycle/users_modes.py: its callbacks empty the stack for a moment).
        self.apart = False
        self._walked: tuple[FrameType | None, FrameType | None] = (None, None)  # the last op's walk: (from, found)
        self._generated: FrameType | None = None  # the torch.fx-generated frame that walk passed, if any
        # Bytes of the storages the records hold (over-counted: a storage seen twice counts twice), a large
        # one counting past KEEP_TOTAL on its own: while within it, weaken() has nothing to let go.
        self._held_bytes = 0
        #: Regions whose recording a step turned off by running more ops than their budget.
        self.untraced: set[str] = set()
        #: A data region ran over its budget: DataLoader batches are fetched aside since (patches/loaders.py).
        self.batches_aside = self._retried = False  # (the next region is recorded again; over it again, off)
        #: Called before an op that writes in place runs in a data region being recorded (``on_write(its plan,
        #: args, kwargs)``): a parameter the loop writes after the optimizer step (param_writes.py's DataWrites).
        self.on_write: Callable[[Plan, Sequence[Any], dict[str, Any]], None] | None = None
        self.then_forget: OutsideRecorder | None = None  # forgotten with the next forget (the update region's records)
        self.read_number = False  # whether the region's code read a number (``.item()``: update_recorder.py)
        self._through_step: OutsideRecorder | None = None  # then_forget, kept through the optimizer step (forget)
        self._through_next = False  # _through_step is kept through the data region's start after the step too
        self._data_kept = 0  # bytes the held data records keep (at most KEEP_TOTAL: _hold_update_region)

    def start(self, region: str, entry: bool = False, goes_on: Callable[[], bool] | None = None) -> None:
        """Record ``region`` (``"loss"`` after a model call, ``"data"`` after an optimizer step), afresh.

        ``entry``: the data code before the first model call (it often builds the model: over budget there,
        only that region goes unrecorded). ``goes_on()``: another model call of the same step returned (no
        backward since): the loss code may go on from what it computed before it (``p = model(x).softmax(-1)``,
        then ``loss = F.cross_entropy(model(x2), y) - entropy(p)``), so its few records stay
        (:data:`GOES_ON_MAX`; more, as an evaluation with gradients on records, and it starts afresh).
        """
        if (goes_on is not None and region == "loss" and self._region == "loss" and 0 < len(self._ops) <= GOES_ON_MAX
                and self._budget > 0 and goes_on()):
            self._push()
            return
        # Held by batch_entered: the batch they made is judged at the step's check (deferred), or at the call's end;
        # through the loss region in either mode, whose code may read what they made (an unwatched teacher's output).
        if region == "data" or (region != "loss" and not self.holds_data):
            self._data_prior = (*self._data_head, self._data_calls) if self._data_head is not None else self._data_prior
            self._data, self._data_before, self._data_calls, self._data_kept = None, {}, {}, 0
            self._data_head = None
            self.stepped = self.stepped or (region == "data" and not entry)  # (an optimizer stepped: see forget)
        if not self._clean:  # (forgotten as the last region ended, and not pushed since: the loss region's start
            self.forget()    # after its model call, the data region's after the optimizer step)
        if region in self.untraced:
            if region != "data" or self._retried or not self.batches_aside:
                return
            self.untraced.discard(region)
            self._retried = True
        self._region = region
        self._entry = entry
        self._budget = DATA_BUDGET if region == "data" else UPDATE_BUDGET if region == "update" else LOSS_BUDGET
        self._push()

    def batch_entered(self, goes_on: Callable[[], bool] | None = None) -> None:
        """A top-level model call began, its positional batch judged: the data region's records are held.

        Through the call and its loss region (:meth:`start`; :meth:`claim` looks there too): a keyword argument
        (``model(**batch)``, ``model(pixel_values=x)``) is judged there, or where the forward first reads it, and the
        loss code may read what the data code made (an unwatched teacher's output). With :attr:`holds_data`, until the
        next data region starts: the deferred check judges the batch at the optimizer step. ``goes_on()``: a loss
        region's few records stay for the call's return to decide (:meth:`start`).
        """
        if goes_on is not None and self._region == "loss" and 0 < len(self._ops) <= GOES_ON_MAX and goes_on():
            if self.then_forget is not None:
                self._hold_update_region()
            return
        if self._region == "data" and self._ops:
            # (Large tensors held weakly, as the loss code's are through backward: the batch itself is the
            # model's argument, alive while the step runs; a temporary freed since leaves its op unnamed.)
            # Held through the call and its loss region in either mode: a returned helper's frame would keep its
            # locals alive (a large temporary of the data code) through the forward and backward; small ones stay.
            self._let_go_of_returned_frames(keep_small=True)
            ops = weakened(self._ops) if self._held_bytes > KEEP_TOTAL else self._ops  # (after: records rebuilt)
            self._data, self._data_kept = (ops, self._produced, self._rng), min(self._held_bytes, KEEP_TOTAL)
            self._data_head = self._data, self._data_before  # (claim: past a long loss region's records)
            self._ops, self._produced, self._n_ops = [], {}, 0
            self._data_calls, self._calls, self._last_frame = self._calls, {}, None  # (the frame, with them)
            if self.before:  # a parameter's value before the data code wrote it (param_writes.py)
                self._data_before, self.before = self.before, {}
        elif self._region == "loss" and self._ops and self.holds_data:
            # No optimizer step since the last model call (a soft prompt stepped by hand after autograd.grad, a
            # second call fed by the loss code): that code made this batch, and the deferred check judges it after
            # this call's loss region began. Held as a copy: forget() keeps the loss code as the last step's too.
            # (The data region's own records stay apart, in ``_data_head``, for a batch the data code made that the
            # check judges after this call: claim.)
            self._let_go_of_returned_frames()
            ops = weakened(self._ops) if self._held_bytes > KEEP_TOTAL else list(self._ops)
            self._data, self._data_calls = (ops, dict(self._produced), self._rng), dict(self._calls)
            self._data_kept = min(self._held_bytes, KEEP_TOTAL)
            self._data_before = dict(self.before)
        if self.then_forget is not None:  # (none on the usual step: an optimizer step forgot it)
            self._hold_update_region()
        if not self._clean:
            self.forget()

    def _hold_update_region(self) -> None:
        """No optimizer step since the last backward (accumulation's next micro-batch): the update region's records
        (:attr:`then_forget`) made this batch: held for the step's check (deferred), or where :meth:`claim` found its op
        there, for the fix trial as the call ends; after the data records so far, within :data:`KEEP_TOTAL`, weakly."""
        held = self.then_forget  # (immediate too: the loss code may read what it made, targets standardised)
        if held is None or self._region == "data" or not held.settled():
            return
        prior_ops, prior_produced, prior_rng = self._data if self._data is not None else ([], {}, None)
        budget = max(0, KEEP_TOTAL - self._data_kept)
        start = len(prior_ops)
        self._data = ([*prior_ops, *weakened(held._ops, budget)],
                      {**prior_produced, **{key: index + start for key, index in held._produced.items()}},
                      prior_rng or held._rng)  # (one random state: the first region's that drew)
        self._data_kept += min(budget, held._held_bytes)
        self._data_calls = {**self._data_calls, **held._calls}
        self._data_before = {**self._data_before, **held.before}

    def claim(self, tensor: torch.Tensor | None, key: int | None = None, written: bool = False) -> OpFinding | None:
        """:meth:`RegionRecords.claim`, then in the update region's records held for the step's check
        (:attr:`then_forget`): a batch the loop's code made after a backward with no optimizer step since (gradient
        accumulation's next micro-batch, standardised in the loop), judged as the next call begins."""
        found = super().claim(tensor, key, written)
        held = self.then_forget
        if found is None and held is not None and held.settled():
            found = held.claim(tensor, key, written)
            if found is not None:  # (what the report reads of the claim: the held region's witness and calls)
                self._witness, self.frame_note, self._clean = held._witness, held.frame_note, False
                self.claimed_in_graph_grad = held.claimed_in_graph_grad
                self._data_calls = {**held._calls, **self._data_calls}
        return found

    def settled(self) -> bool:
        """Whether the region holds records, every op it ran made one first (an update region's watched ops:
        update_recorder.py)."""
        return bool(self._ops)

    def graph_grad_begins(self) -> bool:
        """An ``autograd.grad(create_graph=True)`` of the loop's code begins (patches/backward.marked_graph_grads):
        the ops its backward runs are recorded at the loop's line that called it, noted as such a site. Steps
        nothing aside (False)."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and passed_over(frame.f_code):
            frame = frame.f_back
        if frame is not None:
            self.graph_grad_sites.add((frame.f_code, frame.f_lasti))
        return False

    def forget(self, last: bool = False, stepping: bool = False, others: bool = False) -> None:
        """Drop the records (and the references they hold); ``last``: the last step's loss code too (the watch ends).

        A loss region's records (its backward ended, or its optimizer step began) are kept instead as the last
        step's (:meth:`loss_code`): with :attr:`stepped` (an optimizer given or seen stepping), as recorded until its
        step begins; with :attr:`keep_last`, detached or weak until the next step's, for a fix trial at its forward.
        ``stepping``: the step runs next; the update region's records that read a number (``lr = size.item()``) stay
        through it (as held until then) for its check to name the op that made a non-finite rate (loop_writes.py).
        ``others``: another optimizer is watched; the update region's records stay until the next model call or
        optimizer step, whose check may judge a gradient they wrote (two models, one optimizer each: ``p.grad /=
        p.grad.norm()`` on the second's gradients, judged at its own step, after the first's).
        """
        if self._through_step is not None and (stepping or last or not self._through_next):
            kept, self._through_step = self._through_step, None
            kept.forget()
        self._through_next = False
        if self.then_forget is not None:  # the update region's records, held for the step's check (loop_writes)
            held, self.then_forget = self.then_forget, None
            if stepping and (held.read_number or others) and held._held_bytes <= KEEP_TOTAL:
                self._through_step = held  # (what they held until the step began, held through it too)
                self._through_next = others  # (and through the data region's start after it: step_judged)
            else:
                held.forget()
        if last:
            self._last = self._data = self._data_head = self._data_prior = None
            self._data_before, self._data_calls, self._loss_before = {}, {}, []
        elif self._ops and self._region == "loss" and (self.keep_last or self.stepped):
            if self.keep_last:
                self.weaken(detach=True)
            self._last, self._raw = (self._ops, self._produced, self._rng), not self.keep_last
            self._ops, self._produced, self._n_ops = [], {}, 0
        elif self._raw:  # the optimizer step began (or the next batch): the records held as recorded go, but what
            self._loss_before, self._last, self._raw = detached_from_model(self._last), None, False  # it detached
        if self._ops:  # (forgetting happens several times a step, mostly with nothing recorded)
            self._ops.clear()
            self._n_ops = 0
            self._produced.clear()
        if self._calls or self._last_frame is not None:  # (a frame held keeps its locals: the loop's, past the watch)
            self._calls, self._last_frame = {}, None  # (no call: forgetting happens several times a step)
        self._held_bytes = 0
        self._rng = None
        if self._applied:
            self._applied = {}
        self._witness = None
        self._walked, self._generated = (None, None), None
        if self.before:
            self.before.clear()
        self._clean = not self._raw and self._through_step is None  # (both go at the next forget)

    def weaken(self, detach: bool = False) -> None:
        """``backward()`` starts, the loss judged: keep large tensors only weakly, for its backward (``detach``:
        small ones as detached copies too, as the last step's records are kept past it: forget).

        A large tensor (logits) is freed as it would be unwatched, except what autograd saved; small ones stay
        (:data:`KEEP_BYTES`, :data:`KEEP_TOTAL`: a backward replay needs the intermediates autograd frees as each
        node runs; one that needs a freed tensor gives up). The usual launch-bound step holds small tensors only:
        its records stay as they are, only the frames of functions that returned are let go.
        """
        # A returned loss helper's small frame stays: a backward producer is named at its forward line there, and
        # %debug opens in it (claim_backward).
        if self._held_bytes <= KEEP_TOTAL and not detach:
            self._let_go_of_returned_frames(keep_small=True)
            return
        self._ops = weakened(self._ops)
        self._let_go_of_returned_frames(keep_small=True)  # holding a running one costs nothing

    def _let_go_of_returned_frames(self, keep_small: bool | None = None) -> None:
        """Drop the frames of recorded ops whose function has returned (a held frame keeps its locals), but,
        for the deferred check (:attr:`holds_data`) or with ``keep_small``, a helper's whose tensors are small
        (held.small_frames): %debug opens there at the op. The immediate check judged the loss before this is called;
        a data region's records serve its loss region's claims in either mode (batch_entered)."""
        self._walked, self._generated = (None, None), None  # (a held frame keeps its locals, a large tensor too)
        let_go = returned_let_go(self._ops, self._calls, self.holds_data if keep_small is None else keep_small)
        if let_go is not None:  # (None: the usual loss, written in the loop's own frame, still running)
            self._ops, self._calls, applied = let_go
            self._last_frame = None
            if applied:
                self._applied.update(applied)

    def note(self) -> Note | None:
        """What a report says where the code outside the models went unrecorded."""
        if not self.untraced:
            return None
        return Note.of("outside-untraced", regions=tuple(sorted(self.untraced)), loss_budget=LOSS_BUDGET,
                       data_budget=DATA_BUDGET)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # Every op of the region passes here, on every healthy step: each line below is paid per op,
        # so lookups are cached per op and per code object, and nothing is read from a tensor.
        try:  # cached on the op: reading an attribute is no call (a dict by id: two; an OpOverload's hash is Python)
            kind, call, _op, writes = func._nan_magic_outside
        except AttributeError:
            kind, call, _op, writes = op_entry(func)
        if kwargs is None:
            kwargs = {}
        if kind is PASS:  # record_function's markers, .item()'s _local_scalar_dense: nothing to replay (passes)
            return call(*args, **kwargs)
        if writes is not None and self._budget > 0:  # (an op that writes in place: the usual loss has none)
            if self._region == "loss":
                self.keep_before_write(writes, args, kwargs)  # a model's output the loss code writes (region_records)
            elif self._region == "data" and not self._entry and self.on_write:
                self._clean = False  # (it may copy a parameter into ``before``)
                self.on_write(writes, args, kwargs)  # (as it found it; not the entry's: a model's init, too early)
        if kind is SEEDED_OP and self._budget > 0:
            if self._rng is None:
                # The region's first random op: a replay draws the same numbers from this state (taken
                # only where the region draws any, so the usual loss costs no copy of the generators).
                self._rng = capture_rng_state()
                self._clean = False
            if kwargs.get("generator") is not None or _GENERATOR in map(type, args):
                self._rng = with_user_generator(self._rng, kwargs.get("generator"), args)  # (the user's own)
        try:
            out = call(*args, **kwargs)
        except RuntimeError as error:  # a wrapped number alone (run_op says why); only the failure path pays
            __tracebackhide__ = True  # (the user's own error shows with their frames, as unwatched)
            out = run_rewrapped(func, args, kwargs, error)
        if self._budget <= 0:
            if self._budget == 0:  # over budget: the region is not recorded again
                self._budget = _INERT
                if not self._entry:
                    self.untraced.add(self._region)
                    # (A DataLoader's fetch, most often: the data region is tried again once, without it: start.)
                    self.batches_aside = self.batches_aside or self._region == "data"
                self.forget()
            return out
        # An in-place foreach op returns nothing: recorded as returning the list it wrote (an EMA's _foreach_copy_).
        returned, out = out, (args[0] if out is None and writes is not None and args else out)
        # The user's frame: the innermost one that is not torch's or ours (user_frame, inlined and cached); the last
        # op's walk where this one runs in the same frame (still running: the same callers), as most ops of a loss do.
        frame: FrameType | None = sys._getframe(1)
        if frame is self._walked[0]:
            frame = self._walked[1]
        else:
            start, self._generated = frame, None
            while frame is not None:
                passed = PASSED_OVER.get(code := id(frame.f_code))
                if not (passed[1] if passed is not None else passed_over(frame.f_code)):
                    break
                if code in ZERO_GRAD_CODES:  # a zero_grad() bound before the watch patched it: not the loop's
                    return returned
                if code in GENERATED:  # (a compiled function's graph: its node's line is the op's, generated.py)
                    self._generated = frame
                frame = frame.f_back
            self._walked = (start, frame)
            self._clean = False  # (every op recorded since forget() walked here first: the walk or the records go)
        self._budget -= 1
        index = self._n_ops
        self._n_ops = index + 1
        if frame is not self._last_frame and frame is not None:  # a helper's first op: where it (and its caller)
            self._last_frame = frame                              # was called, for frames in call order
            if frame not in self._calls:
                back = frame.f_back
                self._calls[frame] = None if back is None else (back, back.f_lasti, line_at(back))
                if back is not None and back not in self._calls:
                    up = back.f_back
                    self._calls[back] = None if up is None else (up, up.f_lasti, line_at(up))
        # (tuple.__new__ directly: a named tuple's own __new__ is one Python call more.)
        if frame is None:
            self._ops += (_new_tuple(RecordedOp, (func, tuple(args), kwargs, out, None, 0, None, -1, None)),)
        else:
            # The line kept by instruction (line_at, inlined: f_lineno scans the code's line table at each read).
            user_code, lasti = frame.f_code, frame.f_lasti
            try:
                line = LINES[user_code.co_linetable, user_code.co_firstlineno, lasti] if frame.f_trace is None else (
                    frame.f_lineno)
            except KeyError:
                line = line_at(frame)
            if self._generated is not None:
                line = generated_line(self._generated, user_code, line)
            self._ops += (_new_tuple(RecordedOp, (func, tuple(args), kwargs, out, user_code, line,  # (+=, no call)
                                                  frame.f_globals, lasti, frame)),)
        if type(out) is torch.Tensor:  # most ops: no walk of a pytree
            self._produced[id(out)] = index
            base = out._base  # bytes_held, inlined
            try:
                size = (out if base is None else base).nbytes
            except RuntimeError:  # a sparse COO tensor has no nbytes: counted as too large to keep, held weakly
                size = KEEP_TOTAL + 1
            self._held_bytes += size if size <= KEEP_BYTES else KEEP_TOTAL + 1
        else:
            flat = type(out) is tuple or type(out) is list  # (max and its index: a flat tuple, no pytree walk)
            if flat:
                for item in out:  # (a loop, not all() over a generator: each of its items is a call)
                    if type(item) is tuple or type(item) is list:
                        flat = False
                        break
            for tensor in out if flat else tree_leaves(out):
                if type(tensor) is torch.Tensor:  # (bytes_held, inlined as above: nll_loss's pair, max's)
                    self._produced[id(tensor)] = index
                    base = tensor._base
                    try:
                        size = (tensor if base is None else base).nbytes
                    except RuntimeError:  # (sparse COO, as above)
                        size = KEEP_TOTAL + 1
                    self._held_bytes += size if size <= KEEP_BYTES else KEEP_TOTAL + 1
                elif isinstance(tensor, torch.Tensor):
                    self._produced[id(tensor)] = index
                    self._held_bytes += held_bytes(tensor)
        # What came from outside (a model's logits; in a list for cat or stack); an earlier op's output
        # counts again.
        for value in args:
            if type(value) is torch.Tensor:
                base = value._base  # bytes_held, inlined: most ops read one or two tensors
                try:
                    size = (value if base is None else base).nbytes
                except RuntimeError:  # (sparse COO: a graph's adjacency given to torch.sparse.mm)
                    size = KEEP_TOTAL + 1
                self._held_bytes += size if size <= KEEP_BYTES else KEEP_TOTAL + 1
            elif type(value) is list or type(value) is tuple:  # (mostly dims and sizes: a loop, no call)
                for item in value:
                    if type(item) is torch.Tensor:
                        self._held_bytes += bytes_held(item)
        if kwargs:
            for value in kwargs.values():
                if isinstance(value, torch.Tensor):
                    self._held_bytes += held_bytes(value)
        return returned

    def recording(self) -> bool:
        """Whether the next op is recorded (within the region's budget)."""
        return self._budget > 0


_new_tuple = tuple.__new__
_GENERATOR = torch.Generator
