"""A recorded region's ops, and what an event asks of them: which op made a value non-finite, and how.

:class:`RegionRecords` is what :class:`~nan_magic.localize.outside.recorder.OutsideRecorder` (the dispatch mode,
which fills it op by op) keeps of the code outside the watched models: each op with its arguments and outputs
(references, no copies), the user's frame that ran it, which op returned which tensor, and the generators' state the
region's first random op found. Nothing here runs on a healthy step: :meth:`RegionRecords.claim` and
:meth:`RegionRecords.claim_backward` run the recorded ops again under the op tracer when the loss (or a batch built
in the loop, or the gradient from the loss code) holds a non-finite value; :meth:`RegionRecords.loss_code` gives a
fix trial the ops that made the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import CodeType, FrameType
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from nan_magic.hot.kept.rng import RngState, generators_at
from nan_magic.localize.ops.origins import OpFinding
from nan_magic.localize.ops.plans import Plan
from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.localize.outside.applied import Applied, rerun_applied
from nan_magic.localize.outside.held import KEEP_BYTES, KEEP_TOTAL
from nan_magic.localize.outside.recorded_ops import (
    Detached,
    EarlierLoss,
    Gone,
    RecordedOp,
    WeakRecord,
    benign_copies,
    copies_from_outside,
    divisor_spread,
    finite_now,
    frame_note,
    last_write,
    made_from_outside_data,
    maker,
    op_source,
    ops_to,
    ops_to_key,
    record_key,
    rerun_op,
    with_early_loss_code,
    written_by,
)
from nan_magic.records import Note

__all__ = ["RegionRecords"]


#: One region's records: its ops (each with the user's frame that ran it, while held), which op returned which
#: tensor (by id), and the generators' state its first random op found.
_Records = tuple[list[RecordedOp], dict[int, int], RngState | None]


class RegionRecords:
    """The records of the region recording now (and of the last loss region), and the questions put to them."""

    def __init__(self, kinds: frozenset[str]) -> None:
        self.kinds = kinds
        # Values copied before an op wrote them in place, where a replay must start (outside/loop_writes.py fills it).
        self.before: dict[int, torch.Tensor] = {}
        self._ops: list[RecordedOp] = []
        self._n_ops = 0  # len(self._ops), kept where it changes (the recorder's dispatch asks no len() per op)
        # Where each of those frames was called: the calling frame, its f_lasti and line then (recorder.py notes
        # it at a frame's first op), for a report's frames in call order (errors/frames.py); None where unknown.
        self._calls: dict[FrameType, tuple[FrameType, int, int] | None] = {}
        self._last_frame: FrameType | None = None
        self._data_calls: dict[FrameType, tuple[FrameType, int, int] | None] = {}  # held with ``_data``
        self._produced: dict[int, int] = {}  # id(output tensor) -> index of the op that returned it
        self._rng: RngState | None = None
        # The custom Functions' applies among the ops, by the index of each one's first op (outside/applied.py):
        # noted as their frames are let go, for a backward replay that runs their own backward.
        self._applied: dict[int, Applied] = {}
        # The last loss region's records, kept by forget(): (ops, produced, rng).
        self._last: tuple[list[RecordedOp], dict[int, int], RngState | None] | None = None
        self._raw = False  # whether ``_last`` holds them as recorded (the step's graph with them: forget)
        self._loss_before: Detached = []  # what the loss code before those detached of the model, weakly (forget)
        # The last data region's records, kept by forget() through the loss region (until the deferred check has
        # judged the batch they made, with the recorder's ``holds_data``): (ops, produced, rng).
        self._data: _Records | None = None
        # The data region's own records and their ``before``, held with ``_data`` while a step's later model calls
        # replace it (an accumulating step's: the loss code's records past GOES_ON_MAX ops, recorder.batch_entered):
        # the deferred check runs as the next micro-batch's call starts, and may judge a batch the data code made
        # before the first (normalised whole, then chunked).
        self._data_head: tuple[_Records, dict[int, torch.Tensor]] | None = None
        # The data region's own records before those (``_data_head`` as a data region's start let it go, with its
        # calls), one generation: a prefetcher prepares the next batch one step ahead (NVIDIA's data_prefetcher),
        # so the code that made the batch a call judges ran in the data region before the one that ended at that
        # call. Held as ``_data`` held them (weak where over KEEP_TOTAL), until the next data region with records.
        self._data_prior: tuple[_Records, dict[int, torch.Tensor], dict[FrameType, Any]] | None = None
        # The values copied before the data region's code wrote them (``before`` as it was), held with ``_data``.
        self._data_before: dict[int, torch.Tensor] = {}
        # The last op :meth:`claim` named, with copies of its output and operands and the frame that ran it.
        self._witness: tuple[OpFinding, tuple[tuple[str, torch.Tensor], ...], FrameType | None,
                             tuple[int, int] | None] | None = None
        #: What a report says where %debug cannot show the locals the line of the op :meth:`claim` named left: its
        #: frame was let go, or ran that line again since (recorded_ops.frame_note); None where it can.
        self.frame_note: Note | None = None
        # Whether forget() would find nothing to drop: it ran, and nothing was recorded, walked, copied or named
        # since (set False where each is). Read before the forget at a region's start and at a model call.
        self._clean = False
        #: ``(code, f_lasti)`` of the loop's calls of ``autograd.grad(create_graph=True)`` (recorder.graph_grad_begins):
        #: an op recorded at one ran in that grad's backward, a gradient formula, not the loop's own code.
        self.graph_grad_sites: set[tuple[Any, int]] = set()
        #: Whether the op :meth:`claim` named last ran in such a backward.
        self.claimed_in_graph_grad = False
        #: Whether it made, from outside data alone, a tensor the data code built that the loss code read (a target).
        self.claimed_from_data = False
        #: The watched root whose own forward hook a recorded op's code (and frame, where held) is, else None
        #: (owners.root_hook_module, bound to the watch's roots): torch runs that hook after the watch's post-hook
        #: started the loss region, and the root's call ran its ops. None: no watch names roots.
        self.root_hook: Callable[[CodeType, FrameType | None], str | None] | None = None
        self.benign_input: Callable[[torch.Tensor], bool] | None = None  # a read tensor a benign event judged
        #: Told of a tensor needing no gradient that the loss code is about to write in place (deferred: a model
        #: call's input, a batch, may be one; StepKeeping.input_written keeps it as the call read it), else None.
        self.input_written: Callable[[torch.Tensor, int], None] | None = None

    def recorded(self) -> int:
        """How many ops the region recorded so far."""
        return self._n_ops

    def made(self, tensor: torch.Tensor) -> bool:
        """Whether a recorded op returned ``tensor``."""
        return id(tensor) in self._produced

    def keep_before_write(self, plan: Plan, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """The loss code is about to write in place a tensor no recorded op made (a model's output: ``out.div_(s)``):
        copy it first, as the data region copies a parameter (param_writes.py), so that :meth:`claim`'s replay
        starts from the value the region's ops before the write read, not from the write's result.

        The recorder calls it only for an op that writes in place (a loss without one pays nothing). Only a tensor
        that requires gradients, passed as itself (not in a list: ``zero_grad(set_to_none=False)``'s
        ``_foreach_zero_`` of the gradients costs one test), is copied: a model's output, not a gradient or a label;
        the first write of each, one of at most :data:`KEEP_BYTES` within :data:`KEEP_TOTAL` a region."""
        for index, name in enumerate(plan.names):
            if name not in plan.writes:
                continue
            tensor = args[index] if index < len(args) else kwargs.get(name)
            if (self.input_written is not None and type(tensor) is torch.Tensor and not tensor.requires_grad
                    and tensor.layout is torch.strided and not tensor.is_nested and tensor.nbytes <= KEEP_TOTAL):
                self.input_written(tensor, KEEP_TOTAL)  # (the batch written after the call read it: a second view)
            if (type(tensor) is not torch.Tensor or not tensor.requires_grad or id(tensor) in self.before
                    or self.made(tensor)):
                continue
            try:
                size = tensor.nbytes  # (numel times element size, as for the values already kept)
            except RuntimeError:  # (a sparse COO tensor has none: not copied)
                continue
            if size <= KEEP_BYTES and size + sum(kept.nbytes for kept in self.before.values()) <= KEEP_TOTAL:
                self.before[id(tensor)] = tensor.detach().clone()
                self._clean = False  # (forget() empties ``before``)

    def made_on(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The latest tensor a recorded op of the region recording now returned on ``tensor``'s memory, or None.

        ``param.data = vector[i:j].view_as(param)`` (``vector_to_parameters``) rebinds a parameter to memory a
        recorded op made, with no op of its own: the op chain to that output names what made it. Asked only for a
        parameter whose memory changed (loop_writes.py).
        """
        address = tensor.untyped_storage().data_ptr()
        for op in reversed(self._ops):
            for out in tree_leaves(op.out):
                if (type(out) is torch.Tensor and out.layout is torch.strided and out.numel()
                        and out.untyped_storage().data_ptr() == address):
                    return out
        return None

    def written(self) -> list[torch.Tensor]:
        """The tensors the recorded ops wrote in place, each once, in the order first written."""
        return written_by(self._ops)

    def adopt(self, other: RegionRecords) -> None:
        """Go on with ``other``'s records after this region's own: the update region's code, which a second
        ``backward()`` showed to be that loss's code (outside/loop_writes.py's :meth:`LoopWrites.loss_starts`).

        The records are appended (their tensors' indices moved past this region's), so a replay of the ops that
        made the second loss starts from what the first loss code computed (an output both read, a retained graph).
        """
        start = len(self._ops)
        self._ops.extend(other._ops)
        self._n_ops = len(self._ops)
        self._produced.update((key, index + start) for key, index in other._produced.items())
        self._calls.update(other._calls)
        self.before.update(other.before)
        self._rng = self._rng if self._rng is not None else other._rng
        self._clean = False

    # -- at an event ----------------------------------------------------------------------

    def claim(self, tensor: torch.Tensor | None, key: int | None = None, written: bool = False) -> OpFinding | None:
        """The recorded op that first made a value non-finite on the way to ``tensor``, or None.

        None when ``tensor`` was not made by recorded code, or when its non-finite values came from outside the record
        (a model output). ``key``: the id of a ``tensor`` freed since (a temporary loss, at the deferred check).
        ``written``: a batch entering a model, into which the recorded code may have written a number (``x[3] = nan``).
        """
        self.claimed_from_data = False
        found = self._claim_in((self._ops, self._produced, self._rng), tensor, key, self.before, written)
        if found is None and self._data is not None:  # a batch the data code made, judged at the deferred check
            found = self._claim_in(self._data, tensor, key, self._data_before, written)
            self.claimed_from_data = found is not None and tensor is not None and made_from_outside_data(
                self._data[0], tensor, self._earlier_loss())
        if found is None and (head := self._data_head) is not None and head[0] is not self._data:
            found = self._claim_in(head[0], tensor, key, head[1], written)
            self.claimed_from_data = found is not None and tensor is not None and made_from_outside_data(
                head[0][0], tensor, self._earlier_loss())
        if found is None and self._data is not None and tensor is not None:
            found = self._claim_written(tensor, self._data)
        if found is None and tensor is not None and (prior := self._data_prior) is not None and (
                prior[0] is not self._data):
            found = self._claim_in(prior[0], tensor, key, prior[1], written)
            if found is not None:  # (the frames of the code that ran it: the report's calls, calls_to)
                self.claimed_from_data = made_from_outside_data(prior[0][0], tensor, self._earlier_loss())
                self._data_calls = {**prior[2], **self._data_calls}
        return found

    def _claim_written(self, tensor: torch.Tensor, data: _Records) -> OpFinding | None:
        """The held data code's op that made ``tensor`` non-finite in place (a center loss's centers, moved after the
        optimizer step: ``centers[c] += m * (f[y == c].mean(0) - centers[c])``), or a tensor its ops read from outside
        (an unwatched teacher's soft targets under the loss code's ``log``), the records run again to that write."""
        data_ops, rng = data[0], data[2]
        reads: list[Any] = [tensor]  # (itself, read from the user's variables; or what its ops read from outside)
        made: set[int] = set()
        for op in ops_to(self._ops, self._produced, tensor) or ():
            reads.extend(value for value in tree_leaves((op.args, op.kwargs)) if record_key(value) not in made)
            made.update(key for key in map(record_key, tree_leaves(op.out)) if key is not None)
        for value in reads:
            read = value.ref() if isinstance(value, WeakRecord) else value
            if (isinstance(read, torch.Tensor) and read.is_floating_point() and read.layout is torch.strided
                    and read.numel() and not finite_now(read)):
                last = last_write(data_ops, -1, read)
                found = self._claim_ops(data_ops[: last + 1], rng, self._data_before, id(read), data_ops) if (
                    last >= 0) else (
                    self._claim_in(data, read, None, self._data_before) if read is not tensor else None)
                if found is not None:
                    # What the data code built from outside data alone, which the loss code read: data, not loss code.
                    self.claimed_from_data = read is not tensor and made_from_outside_data(
                        data_ops[: last + 1] if last >= 0 else data_ops, read, self._earlier_loss())
                    return found
        return None

    def _earlier_loss(self) -> EarlierLoss:
        """What the loss code before the data region's made from the model (``_last`` as recorded is this step's)."""
        return self._loss_before, (self._last[0] if self._last is not None and not self._raw else None)

    def made_deliberately(self, tensor: torch.Tensor) -> bool:
        """Whether the recorded ops made ``tensor``'s non-finite values from a deliberate infinity alone.

        ``q.masked_fill(~legal, -inf).max(1).values`` in the loss code (a DQN's bootstrap over the legal actions
        of a state that has none): no op is its producer (:meth:`claim` finds none), and it is no data entering the
        loss code either, though it needs no gradient: its consumer that turns it into a NaN is the producer.
        """
        ops = ops_to(self._ops, self._produced, tensor)
        if ops is None:
            return False
        tracer = OpTracer(kinds=self.kinds)
        try:
            copies, _requiring = copies_from_outside(ops, self.before)
            with torch.no_grad(), generators_at(self._rng), tracer:
                for op in ops:
                    rerun_op(op, copies)
        except Gone:
            return False
        replayed = copies.get(id(tensor))
        return replayed is not None and tracer.origin_of(replayed) == "benign"

    def _claim_in(self, records: _Records, tensor: torch.Tensor | None, key: int | None,
                  before: dict[int, torch.Tensor], written: bool = False) -> OpFinding | None:
        """:meth:`claim` in one region's ``records``."""
        recorded, produced, rng = records
        if tensor is not None:
            ops = ops_to(recorded, produced, tensor)
        else:
            ops = ops_to_key(recorded, produced, key) if key is not None else None
        if ops is None:
            return None
        return self._claim_ops(ops, rng, before, record_key(tensor) if tensor is not None else key, recorded, written)

    def _claim_ops(self, ops: list[RecordedOp], rng: RngState | None, before: dict[int, torch.Tensor],
                   target: int | None, every: list[RecordedOp], written: bool = False) -> OpFinding | None:
        """The op of ``ops``, run again on copies under the op tracer, whose non-finite value reached the tensor
        ``target`` (its key: the last op made or wrote it), as ops=True claims one at a boundary. An op whose value
        reached no such tensor is not it: a metric the same loss helper only logs (``(s / 0).item()``, inf every
        step), an overflow ``tanh`` absorbed. ``written`` (a batch entering a model): where no op made its value,
        the op that lifted a number the code wrote into it (``x[3] = nan``). ``every``: the region's records, of
        which ``ops`` is the start."""
        tracer = OpTracer(kinds=self.kinds, at_boundary=True)
        started: dict[int, int] = {}  # the index of the op during whose run each origin started, by its id
        lifted: dict[int, int] = {}  # the index of the op that lifted each non-finite number, by its finding's id
        try:
            copies, _requiring = copies_from_outside(ops, before)
            tracer.note_benign(benign_copies(ops, copies, self.benign_input))  # (a -inf fill the model made)
            # (Without torch.func's transforms: a deferred check can run inside the next step's vmap, where the loop's
            # own ops, a noise draw among them, would run batched or be refused.)
            with torch.no_grad(), generators_at(rng), tracer, torch._C._DisableFuncTorch():
                for ran, op in enumerate(ops):
                    first = len(tracer.started)
                    rerun_op(op, copies)
                    started.update((id(origin), ran) for origin in tracer.started[first:])
                    lifted.update((id(found), ran) for found in tracer.literals if id(found) not in lifted)
                replayed = copies.get(target) if target is not None else None
                if (tracer.claim(replayed) if replayed is not None else None) is None and not (
                        written and replayed is not None and tracer.written_into(replayed) is not None):
                    tracer.claim_earliest()  # no origin known on it (an alias ``.data`` made): the first op's
        except Gone:
            return None
        ran = started.get(id(tracer.finding), lifted.get(id(tracer.finding), -1))
        if tracer.finding is None or ran < 0:
            return None
        # A pick of a mask's infinities that a later sum claimed is the earlier op's (ops/origins.Picked).
        producer = ops[ran] if str(ops[ran].func) == tracer.finding.op else maker(
            tracer.witnesses.output_of(tracer.finding), ops[:ran], copies) or ops[ran]
        frame: FrameType | None = producer.frame
        hooked = self._module_of(producer, frame)
        finding = dataclasses.replace(tracer.finding, source=op_source(producer), inner_source=None,
                                      module=tracer.finding.module if hooked is None else hooked, spread=(
                                          tracer.finding.spread or divisor_spread(producer, ops[:ran])))
        self.claimed_in_graph_grad = (producer.code, producer.lasti) in self.graph_grad_sites
        position = (producer.lasti, producer.lineno) if frame is not None else None
        self._witness = (finding, tracer.producer_tensors, frame, position)
        self._clean = False
        self.frame_note = frame_note(every, producer)
        return finding

    def _module_of(self, op: RecordedOp, frame: FrameType | None) -> str | None:
        """The watched module whose code the recorded ``op`` is, though recorded as the loop's: a root's own forward
        hook (:attr:`root_hook`); else None."""
        return self.root_hook(op.code, frame) if self.root_hook is not None and op.code is not None else None

    def calls_to(self, frame: FrameType | None) -> tuple[tuple[FrameType, int, int], ...]:
        """The calls that led to ``frame``, outermost first: each the calling frame, its f_lasti and line then.

        As far as they were noted (a caller that ran no recorded op, and returned, is not); the last one called
        ``frame``. Empty for a frame not held.
        """
        sites: list[tuple[FrameType, int, int]] = []
        while frame is not None and len(sites) < 32:
            site = self._calls.get(frame) or self._data_calls.get(frame)
            if site is None:
                break
            sites.append(site)
            frame = site[0]
        return tuple(reversed(sites))

    def witness(
        self, finding: OpFinding
    ) -> tuple[tuple[tuple[str, torch.Tensor], ...], FrameType | None, tuple[int, int] | None]:
        """What :meth:`claim` saw of ``finding``'s op: copies of its output then operands, its frame and position.

        The copies are the replay's (the op's own output and operands, for the report's counts and cause);
        the frame is the user's that ran the op, where %debug opens, while it is still known.
        """
        witness = self._witness
        if witness is None or witness[0] is not finding:
            return (), None, None
        return witness[1], witness[2], witness[3]

    def claim_backward(self, loss: torch.Tensor | None, key: int | None = None, last: bool = False
                       ) -> OpFinding | None:
        """The backward op of the recorded loss code that first made a gradient non-finite, or None.

        The ops that made ``loss`` run again with gradients, from copies of what they read from outside (those that
        required gradients still do), then their backward from a gradient of ones, under the op tracer: it names the
        backward op, its autograd node and, from the record, the forward line that created that node. Only for a scalar
        loss (the gradient ``backward()`` starts from is then ones). ``key``: the loss's id when backward started, for a
        deferred check that runs after the loss was freed (its recorded value is kept, being small). ``last``: or in the
        last loss region's records, held as recorded until the optimizer step (a parameter's gradient judged there).
        """
        recorded, produced, rng, applied = self._ops, self._produced, self._rng, self._applied
        if last and self._raw and self._last is not None and (loss is not None or key is not None) and (
                (id(loss) if loss is not None else key) not in produced):
            # The immediate check at the optimizer step: the loss region's records, kept as recorded (forget).
            (recorded, produced, rng), applied = self._last, {}
        if loss is not None:
            key = id(loss)
            ops = ops_to(recorded, produced, loss) if loss.numel() == 1 else None
        else:
            ops = ops_to_key(recorded, produced, key) if key is not None else None
        if ops is None or key is None:
            return None
        if self._data_head is not None and not applied:
            # The data region's own records (not a loss region's held as a later call's data: batch_entered): a
            # penalty of the parameters the loop computed there, before the model call, is loss code too.
            data = self._data_head[0]
            ops = with_early_loss_code(ops, data[0], data[1])
        # At the boundary, as ops=True judges it: the gradient is claimed, so a forward value the loss code
        # absorbed (a clamp of log(0)) is not the producer; the backward op that read it is.
        tracer = OpTracer(kinds=self.kinds, at_boundary=True)
        # Judged immediately, this runs inside the user's backward (a gradient hook on the model's output): the
        # replayed forward ops belong to that graph task and are forward ops, not a gradient formula's (an exp
        # that overflows there is absorbed, and its backward's 0 * inf is the producer, as at the deferred check).
        tracer.forward_task = torch._C._current_graph_task_id()
        try:
            copies, requiring = copies_from_outside(ops)
            # (The generators as the region's first random op found them: the same draws; the user's put back.)
            born: dict[int, RecordedOp] = {}  # the recorded op each forward origin was started by
            made: dict[int, RecordedOp] = {}  # the recorded op that created each autograd node, by its number
            with torch.enable_grad(), generators_at(rng), tracer:
                index = 0
                while index < len(ops):
                    before, started = torch._C._autograd._get_sequence_nr(), len(tracer.started)
                    unit = applied.get(index)
                    if unit is not None and rerun_applied(unit, recorded, ops, copies, key):
                        # Its own backward: one node, made at the line that called apply.
                        op = ops[unit.first]._replace(code=unit.code, lineno=unit.lineno, globals=None)
                        index = unit.last + 1
                    else:
                        op = ops[index]
                        rerun_op(op, copies)
                        index += 1
                    born.update((id(finding), op) for finding in tracer.started[started:])
                    if op.code is not None:
                        for node in range(before, torch._C._autograd._get_sequence_nr()):
                            # The node's forward line is the recorded op's (the tracer would see this replay's).
                            tracer.node_sources.record(node, op.code, op.lineno, self._module_of(op, op.frame))
                            made[node] = op
                replayed = copies[key]
                if replayed.numel() != 1:
                    return None
                if requiring and replayed.requires_grad:
                    grads = torch.autograd.grad(replayed, requiring, grad_outputs=torch.ones_like(replayed),
                                                allow_unused=True)
                    for grad in grads:
                        if grad is not None and tracer.finding is None:
                            tracer.claim(grad)
        except Gone:
            return None
        finding = tracer.finding
        absorbed = finding.absorbed if finding is not None else None
        if finding is not None and absorbed is not None and id(absorbed) in born:
            # A forward value this replay made and absorbed: its line is the recorded op's (the tracer would see
            # this replay's caller, the loop's ``loss.backward()`` or ``opt.step()``).
            source = op_source(born[id(absorbed)])
            finding = dataclasses.replace(
                finding, absorbed=dataclasses.replace(absorbed, source=source, inner_source=None))
        creator = made.get(finding.node_number) if finding is not None and finding.node_number is not None else None
        self.frame_note = frame_note(recorded, creator) if creator is not None else None
        if finding is not None and creator is not None and creator.frame is not None:
            # %debug opens where the node's forward line ran (a loss helper's frame, kept while its tensors are
            # small: recorder.weaken), with that frame's locals.
            self._witness = (finding, (), creator.frame, (creator.lasti, creator.lineno))
        return finding

    def grad_root(self) -> torch.Tensor | None:
        """The scalar the loss code's own ``torch.autograd.grad`` started from (R1's ``log_d.sum()``), or None.

        Such a backward runs while the loss region records: its first op is autograd's ``ones_like`` of that output,
        recorded with the rest; a gradient into a model output that it made non-finite is no loss backward's.
        """
        for op in reversed(self._ops):
            if op.func is _ONES_LIKE and op.args and type(root := op.args[0]) is torch.Tensor and (
                    root.requires_grad and root.numel() == 1 and self.made(root)):
                return root
        return None

    def loss_code(self, key: int, last: bool) -> tuple[list[RecordedOp], RngState | None] | None:
        """The recorded ops up to the one that returned the tensor ``backward()`` started from (``key``, its id
        then), and the generators' state the region's first random op found; None where no recorded op returned
        it. ``last``: of the last loss region :meth:`forget` kept, not of the region recording now.
        """
        ops, produced, rng = (self._last or ([], {}, None)) if last else (self._ops, self._produced, self._rng)
        index = produced.get(key)
        # A tensor held strongly is alive, so its id is still its own; a weak record keeps the id it had.
        if index is None or not any(record_key(out) == key for out in tree_leaves(ops[index].out)):
            return None
        return ops[: index + 1], rng

    def data_code(self, tensor: torch.Tensor) -> tuple[list[RecordedOp], RngState | None] | None:
        """The recorded data code's ops up to the one that returned ``tensor`` (a batch the loop computed), and the
        generators' state its first random op found; None where no recorded op of the data region returned it.

        The region recording now, or the last one held for the deferred check (:meth:`claim` looks in the same).
        """
        regions = [(self._ops, self._produced, self._rng)]
        if self._data is not None:
            regions.append((self._data[0], self._data[1], self._data[2]))
        for recorded, produced, rng in regions:
            ops = ops_to(recorded, produced, tensor)
            if ops is not None:
                return ops, rng
        return None


_ONES_LIKE = torch.ops.aten.ones_like.default
