"""The ops of the code outside the models as recorded (outside/recorder.py), and running them again at an event.

A :class:`RecordedOp` holds an op, its arguments and outputs by reference,
and the user's line that ran it. Once ``backward()`` starts, the recorded
tensors are held as :class:`WeakRecord` s. At an event the recorder runs the
ops that led to a non-finite value again with :func:`rerun_op`, on
:func:`copies_from_outside` of what they read, under the op tracer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from types import CodeType
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_leaves, tree_map

from nan_magic.errors.frames import pointer_at
from nan_magic.hot.wrapped import is_wrapped
from nan_magic.localize.ops.derived import ModelDerived
from nan_magic.localize.ops.divisor import recorded_spread
from nan_magic.localize.ops.plans import arguments, plan_of, tensors
from nan_magic.localize.replay.module_run import map_tensors
from nan_magic.note_records import Note
from nan_magic.records import SourcePointer

__all__ = ["Detached", "EarlierLoss", "Gone", "RecordedOp", "WeakRecord", "alive", "benign_copies",
           "copies_from_outside", "detached_from_model", "divisor_spread", "finite_now", "frame_note", "last_write",
           "made_from_outside_data", "maker", "op_source", "ops_to", "ops_to_key", "record_key", "rerun_op",
           "swapped", "weak_record", "written_by"]


class RecordedOp(NamedTuple):
    """One recorded op (a named tuple: one is made per op of the code outside the models, every step)."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    code: CodeType | None
    lineno: int
    globals: dict[str, Any] | None
    # The user's frame's ``f_lasti`` when it ran the op, for %debug.
    lasti: int = -1
    # The user's frame that ran the op, while held: the recorder lets go of it (a record with None) at ``weaken``
    # unless it is still running (a returned helper's frame would keep its locals alive through backward).
    # In the record, not in a list beside it: one append an op less.
    frame: Any = None


class WeakRecord:
    """A recorded tensor once ``backward()`` started: held weakly, known by its id when recorded.

    A small one keeps its values (``kept``, detached: holding the tensor itself
    would keep its autograd node, and every tensor that node saved, alive
    through backward); ``requires_grad`` is the original's, for a replay of
    the backward. Not a tuple: pytree would walk into one. ``function``: the custom ``torch.autograd.Function``
    whose ``apply`` returned the tensor (its node's ``_forward_cls``), or None: a fix trial that replays the ops of
    that Function's forward one by one has not the step's backward (fixes/loss.py).
    """

    __slots__ = ("function", "kept", "key", "ref", "requires_grad")

    def __init__(self, ref: weakref.ref[torch.Tensor], key: int, kept: torch.Tensor | None,
                 requires_grad: bool, function: type | None = None) -> None:
        self.ref, self.key, self.kept, self.requires_grad = ref, key, kept, requires_grad
        self.function = function


class Gone(Exception):
    """A tensor a replay needs was freed (only weak references are kept during backward)."""


def weak_record(value: torch.Tensor, keep: bool = False) -> WeakRecord:
    # A tensor without an autograd node (the batch's labels) is kept as it is: there is no node to hold.
    kept = (value if value.grad_fn is None else value.detach()) if keep else None
    return WeakRecord(weakref.ref(value), id(value), kept, value.requires_grad,
                      getattr(value.grad_fn, "_forward_cls", None))


def record_key(value: Any) -> int | None:
    """The recorded tensor's id, for a tensor or a :class:`WeakRecord`; None for anything else."""
    if isinstance(value, torch.Tensor):
        return id(value)
    return value.key if isinstance(value, WeakRecord) else None


def finite_now(tensor: torch.Tensor) -> bool:
    """Whether every value of a recorded tensor is finite now, read detached under no_grad: a view the loop made
    under no_grad of a parameter it then wrote in place with grad on refuses any read autograd would record."""
    with torch.no_grad():
        return bool(tensor.detach().isfinite().all())


def alive(value: Any) -> torch.Tensor:
    """A recorded tensor, still alive; :class:`Gone` where it is not, or where it was a ``torch.func`` transform's
    wrapper (an op the loop's code ran inside ``grad`` or ``vmap``): the transform has returned, and its values
    cannot be run again outside it."""
    if isinstance(value, WeakRecord):
        tensor = value.ref()
        if tensor is None:
            tensor = value.kept
        if tensor is None or is_wrapped(tensor):
            raise Gone
        return tensor
    if isinstance(value, torch.Tensor) and is_wrapped(value):
        raise Gone
    return value



def rerun_op(op: RecordedOp, copies: dict[int, torch.Tensor],
             run: Callable[[RecordedOp, tuple[Any, ...], dict[str, Any]], Any] | None = None) -> None:
    """One recorded op again, on the replay's tensors (its own line: the user's op, for the tracer).

    ``run(op, args, kwargs)`` runs it instead of ``op.func`` (a fix trial's remedy at the producer's line).
    """
    def swap(value: Any) -> Any:
        key = record_key(value)
        return value if key is None else copies.get(key) if key in copies else alive(value)

    args, kwargs = tree_map(swap, op.args), tree_map(swap, op.kwargs)
    out = op.func(*args, **kwargs) if run is None else run(op, args, kwargs)
    if out is None:  # an in-place foreach op (recorded as returning the list it wrote): it wrote the copies read
        return
    for old, new in zip(tree_leaves(op.out), tree_leaves(out)):
        key = record_key(old)
        if key is not None:
            copies[key] = new




def copies_from_outside(
    ops: list[RecordedOp], before: dict[int, torch.Tensor] | None = None, given: dict[int, torch.Tensor] | None = None
) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """Copies of the tensors the ops read that no earlier op returned, and those of them that require grad.

    A replayed in-place op leaves the originals alone; a copy of a tensor
    that required gradients (a model output) requires them too, for a
    replay of the backward. ``before``: values copied before an op wrote them in place (outside/loop_writes.py).
    ``given``: tensors that stand for some of them, by recorded id, taken as they are (a fix trial's outputs).
    """
    made: set[int] = set()
    copies: dict[int, torch.Tensor] = dict(given or {})
    requiring: list[torch.Tensor] = []
    with torch.no_grad():
        for op in ops:
            for value in tree_leaves((op.args, op.kwargs)):
                key = record_key(value)
                if key is not None and key not in made and key not in copies:
                    original = before[key] if before and key in before else alive(value)
                    copy = copies[key] = original.detach().clone()
                    # A kept value is a detached one: its record says whether the original required gradients.
                    if value.requires_grad and copy.is_floating_point():
                        requiring.append(copy.requires_grad_())
            made.update(key for key in map(record_key, tree_leaves(op.out)) if key is not None)
    return copies, requiring


def benign_copies(ops: list[RecordedOp], copies: dict[int, torch.Tensor],
                  benign: Callable[[torch.Tensor], bool] | None) -> list[torch.Tensor]:
    """The copies (:func:`copies_from_outside`, before any op ran again) of what ``ops`` read from outside that
    ``benign`` says the watch judged a deliberate infinity (a model's output masked with -inf, a benign event)."""
    found: dict[int, torch.Tensor] = {}
    if benign is None:
        return []
    for op in ops:
        for value in tree_leaves((op.args, op.kwargs)):
            key = record_key(value)
            original = value.ref() if isinstance(value, WeakRecord) else value
            if key in copies and key not in found and isinstance(original, torch.Tensor) and benign(original):
                found[key] = copies[key]
    return list(found.values())


def swapped(swap: Any, value: Any) -> Any:
    """:func:`~nan_magic.localize.replay.module_run.map_tensors` for what a dispatched op takes and returns, faster.

    Those are tensors, numbers and flat lists or tuples of them: a list or
    tuple holding no tensor is kept as it is, without a copy.
    """
    kind = type(value)
    if kind is torch.Tensor:
        return swap(value)
    if kind is tuple or kind is list:
        if any(type(item) is torch.Tensor for item in value):
            return kind([swap(item) if type(item) is torch.Tensor else swapped(swap, item) for item in value])
        if all(type(item) in _FLAT for item in value):
            return value
    return map_tensors(swap, value)


#: Argument types that hold no tensor (``swapped`` keeps a list of them as it is).
_FLAT = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                   torch.memory_format})

def op_source(op: RecordedOp) -> SourcePointer | None:
    return pointer_at(op.code, op.lineno, op.globals) if op.code is not None else None


def frame_note(every: Sequence[RecordedOp], op: RecordedOp) -> Note | None:
    """Why ``%debug`` cannot show the locals ``op``'s line left, or None where it can.

    The frame was let go (a returned helper's whose tensors were too large to keep: recorder.weaken); or that frame
    ran the same instruction again after ``op``, later in ``every`` (the region's records): a loop's later pass
    (``for task in ...: loss = loss + mse / target.var()``, an EMA's update over each parameter), whose locals the
    frame holds now, not the producing pass's (``task``, ``target`` of the last task). A live tracer (ops=True) copies
    them as the line ends; a recorded op kept no values of the frame, so the report says so. A pass is counted where
    the frame ran another instruction in between: the ops one library call ran (``F.gaussian_nll_loss``'s log, then
    its division) are all recorded at the user's instruction that called it, in one pass.
    """
    if op.code is None:
        return None
    if op.frame is None:
        return Note.of("frame-let-go", function=op.code.co_name, line=op.lineno)
    at = next((index for index, recorded in enumerate(every) if recorded is op), len(every))
    runs, away = 0, False
    for later in every[at + 1:]:
        if later.frame is op.frame and later.lasti != op.lasti:
            away = True
        elif later.frame is op.frame and away:
            runs, away = runs + 1, False
    return Note.of("frame-ran-on", function=op.code.co_name, line=op.lineno, runs=runs) if runs else None


# -- walking the records to a tensor ----------------------------------------------------------

def ops_to(ops: list[RecordedOp], produced: dict[int, int], tensor: torch.Tensor) -> list[RecordedOp] | None:
    """The recorded ops up to the one that returned ``tensor``; None when none did."""
    index = produced.get(id(tensor))
    if index is None:
        return None
    outs = tree_leaves(ops[index].out)
    if not any(out is tensor or (isinstance(out, WeakRecord) and out.ref() is tensor) for out in outs):
        return None
    return ops[: last_write(ops, index, tensor) + 1]


def last_write(ops: list[RecordedOp], index: int, tensor: torch.Tensor) -> int:
    """The last recorded op after ``index`` that wrote ``tensor``'s memory in place, else ``index``.

    ``q = exp(s).t(); q /= q.sum(1, keepdim=True)`` (SwAV's Sinkhorn, under no_grad): the divisions write the
    exp's output through a view. Its value now is theirs, so a replay that stops at the exp would find it finite
    and take the tensor for data entering the loss code; replayed up to the last write, the division is named.
    """
    if tensor.layout is not torch.strided or not tensor.numel():
        return index
    address, last = tensor.untyped_storage().data_ptr(), index
    for later in range(index + 1, len(ops)):
        func = ops[later].func
        plan = plan_of(func) if isinstance(func, torch._ops.OpOverload) else None
        if plan is None or not plan.writes:
            continue
        for name, value in arguments(plan, ops[later].args, ops[later].kwargs):
            written = value.ref() if isinstance(value, WeakRecord) else value
            if (name in plan.writes and isinstance(written, torch.Tensor) and written.layout is torch.strided
                    and written.numel() and written.untyped_storage().data_ptr() == address):
                last = later
    return last


def ops_to_key(ops: list[RecordedOp], produced: dict[int, int], key: int) -> list[RecordedOp] | None:
    """:func:`ops_to` for a tensor gone since, by the id it had when recorded (weakened records know it)."""
    index = produced.get(key)
    if index is None:
        return None
    if not any(isinstance(out, WeakRecord) and out.key == key for out in tree_leaves(ops[index].out)):
        return None
    return ops[: index + 1]


def maker(output: torch.Tensor | None, ran: list[RecordedOp], copies: dict[int, torch.Tensor]) -> RecordedOp | None:
    """The earlier record whose replay made ``output``, the finding's where another op found it: a pick that a later
    sum claimed (ops/origins.Picked); None where none did."""
    if output is None:
        return None
    for op in reversed(ran):
        if any(copies.get(key) is output for out in tree_leaves(op.out) if (key := record_key(out)) is not None):
            return op
    return None


#: What a loss code made from the model's output without a gradient, weakly (:func:`detached_from_model`).
Detached = list[weakref.ref[torch.Tensor]]
#: That of the loss code before a data region, and its records where still held (weakened: ``keep_last``).
EarlierLoss = tuple[Detached, list[RecordedOp] | None]


def made_from_outside_data(ops: list[RecordedOp], tensor: torch.Tensor, earlier: EarlierLoss = ([], None)) -> bool:
    """Whether the recorded ops that made ``tensor`` (its ancestors among ``ops``, by id or by memory: a write through
    a view) read only plain tensors from outside them: none a parameter, none that requires a gradient or came from
    autograd (a model's output), none that the loss code before them made from one (``earlier``).

    A target the loop built from its annotations (FCOS's centerness from box distances) is data (PRODUCT.md: "a
    tensor built in the loop from outside data"); a center loss's centers moved by the model's features, or an
    unwatched teacher's output (its parameters), are not; nor are the model's own soft targets, detached by the loss
    code of the step before (``kept = out.detach().square()``), or a mask of its mistakes (``out.argmax(1) != y``),
    which the data region's records see as plain tensors. Read at an event only.
    """
    if not _from_plain_reads(ops, tensor):
        return False
    detached, last = earlier
    if not detached and not last:
        return True
    # ops mode's taint (localize/ops/derived.py), seeded with them and carried through the records in order: a tensor
    # whose record is gone marks nothing; one overwritten (``copy_`` from the annotations) is outside data again. The
    # table is local: its weak references go with it.
    derived = ModelDerived()
    derived.mark([made for ref in detached if (made := ref()) is not None])  # (not ``tensor``: a walrus binds here)
    for op in [*(last or ()), *ops]:
        plan = plan_of(op.func) if isinstance(op.func, torch._ops.OpOverload) else None
        if plan is not None:
            derived.after_op(plan, *(tree_map(_live, part) for part in (op.args, op.kwargs, op.out)))
    return not derived.holds(tensor)


def detached_from_model(last: tuple[list[RecordedOp], Any, Any] | None) -> Detached:
    """The tensors the loss code's records (``last``: ops, produced, rng) returned without a gradient from a model
    output or a parameter (``out.detach()``, ``out.argmax(1) != y``, an EMA moved in place by them), held weakly for
    the next data region's :func:`made_from_outside_data`, as the records themselves go (the step's graph with them).

    Runs each step as the optimizer step begins: a walk without calls (no ``id``, ``isinstance`` or tensor hash, which
    cProfile counts), only an op whose output is a plain tensor that requires no gradient looking at what it read.
    """
    made: Detached = []
    for op in last[0] if last is not None else ():
        out = op.out
        if type(out) is not torch.Tensor or out.requires_grad:
            continue
        model = False
        for value in op.args:
            # (A list argument, ``torch.stack([...])``: one level, as dispatched.)
            for item in (value if type(value) is list or type(value) is tuple else (value,)):
                kind = type(item)
                if kind is torch.Tensor:
                    model = item.requires_grad
                    for seen in made:  # (by identity: a tensor's hash is a Python call)
                        model = model or seen() is item
                elif kind is torch.nn.Parameter:  # (a frozen one: an unwatched teacher's)
                    model = True
                if model:
                    break
            if model:
                made += (weakref.ref(out),)  # (not ``append``: a call; a weak reference is made by its type)
                if out._base is not None:  # (``buf[:, :4].copy_(out.detach())``: the write marks the buffer too)
                    made += (weakref.ref(out._base),)
                break
    return made


def _live(value: Any) -> Any:
    """A recorded value as it is now: a weakened record's tensor (None where freed)."""
    return value.ref() if isinstance(value, WeakRecord) else value


def _from_plain_reads(ops: list[RecordedOp], tensor: torch.Tensor) -> bool:
    """:func:`made_from_outside_data` within ``ops`` alone."""
    keys, memory = {id(tensor)}, {_memory_of(tensor)}
    made: set[int] = set()
    for op in reversed(ops):
        outs = [(record_key(out), _memory_of(out)) for out in tree_leaves(op.out)]
        if not any(key in keys or at in memory for key, at in outs if key is not None):
            continue
        made.update(key for key, _at in outs if key is not None)
        for value in tree_leaves((op.args, op.kwargs)):
            if (key := record_key(value)) is None:
                continue
            read = value.ref() if isinstance(value, WeakRecord) else value
            grad = value.requires_grad if isinstance(value, WeakRecord) else bool(value.requires_grad)
            if grad or isinstance(read, torch.nn.Parameter) or (read is not None and read.grad_fn is not None):
                return False
            keys.add(key)
            memory.add(_memory_of(value))
    return True


def _memory_of(value: Any) -> int | None:
    """The address of a recorded tensor's storage, while it lives (None for anything else)."""
    tensor = value.ref() if isinstance(value, WeakRecord) else value
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
        return None
    return tensor.untyped_storage().data_ptr() or None


def with_early_loss_code(ops: list[RecordedOp], data: list[RecordedOp], produced: dict[int, int]
                         ) -> list[RecordedOp]:
    """``ops`` (the loss code's, up to the loss) after the data region's ops that made what they read with gradients.

    The loss code may begin before the model call (``penalty = w.abs().sqrt().sum()`` at the loop's top, added to
    the loss after it): its ops were recorded in the data region, and a replay of the loss region alone would take
    their result for a leaf, its backward op unseen. A data-region op that returned a tensor with an autograd node
    (the data code's own tensors have none) which ``ops`` read is put first, with the data-region ops that made the
    others it read from so, in their order. ``produced``: the data region's id(output) -> index of the op that
    returned it.
    """
    def maker_of(value: Any) -> int | None:
        # Only a tensor autograd made (a node's output): a parameter, or a data tensor, is copied as it is now by
        # the replay (a pruning ``w.mul_(mask)`` in the data region is not run again on a leaf that requires grad).
        tensor = value.ref() if isinstance(value, WeakRecord) else value
        if not isinstance(tensor, torch.Tensor) or tensor.grad_fn is None:
            return None
        key = id(tensor) if tensor is value else value.key
        index = produced.get(key)
        if index is None or not any(record_key(out) == key for out in tree_leaves(data[index].out)):
            return None
        return index

    wanted: set[int] = set()
    made: set[int] = set()
    for op in ops:
        for value in tree_leaves((op.args, op.kwargs)):
            if record_key(value) not in made and (index := maker_of(value)) is not None:
                wanted.add(index)
        made.update(key for key in map(record_key, tree_leaves(op.out)) if key is not None)
    if not wanted:
        return ops
    stack = list(wanted)
    while stack:
        op = data[stack.pop()]
        for value in tree_leaves((op.args, op.kwargs)):
            index = maker_of(value)
            if index is not None and index not in wanted:
                wanted.add(index)
                stack.append(index)
    return [data[index] for index in sorted(wanted)] + ops


def copied_nonfinite(ops: list[RecordedOp], tensor: torch.Tensor) -> bool:
    """Whether the last recorded op that wrote ``tensor``'s memory in place read a non-finite tensor it did not write.

    ``model.load_state_dict(best)`` in the loop (a best checkpoint reloaded mid-run) copies a parameter's values from
    a state that already held a NaN: the copy passed it on, no recorded op made it, and the parameter is as one loaded
    before the watch (the next forward meets it already non-finite), not a loop write that made it.
    """
    if tensor.layout is not torch.strided or not tensor.numel():
        return False
    address = tensor.untyped_storage().data_ptr()
    for index in range(len(ops) - 1, -1, -1):
        op = ops[index]
        plan = plan_of(op.func) if isinstance(op.func, torch._ops.OpOverload) else None
        if plan is None or not plan.writes:
            continue
        named = [(name, value.ref() if isinstance(value, WeakRecord) else value)
                 for name, value in arguments(plan, op.args, op.kwargs)]
        if not any(name in plan.writes and isinstance(value, torch.Tensor) and value.layout is torch.strided
                   and value.numel() and value.untyped_storage().data_ptr() == address for name, value in named):
            continue
        sources = [value for name, value in named if name not in plan.writes and name in plan.reads
                   and isinstance(value, torch.Tensor) and value.is_floating_point()
                   and value.layout is torch.strided and value.numel() and not finite_now(value)]
        # (A source a recorded op made, ``w[0, 0] = float("inf")``'s lifted number, is the loop's own write: named.)
        return bool(sources) and not any(_made_by(ops[:index], source) for source in sources)
    return False


def _made_by(ops: list[RecordedOp], tensor: torch.Tensor) -> bool:
    """Whether one of ``ops`` returned ``tensor``'s memory."""
    address = tensor.untyped_storage().data_ptr()
    for op in ops:
        out = op.out.ref() if isinstance(op.out, WeakRecord) else op.out
        if isinstance(out, torch.Tensor) and out.layout is torch.strided and (
                out.untyped_storage().data_ptr() == address):
            return True
    return False


def written_by(ops: list[RecordedOp]) -> list[torch.Tensor]:
    """The tensors ``ops`` wrote in place, each once, in the order first written."""
    seen: dict[int, torch.Tensor] = {}
    for op in ops:
        plan = plan_of(op.func) if isinstance(op.func, torch._ops.OpOverload) else None
        if plan is None or not plan.writes:
            continue
        for _label, tensor in tensors(plan, op.args, op.kwargs, plan.writes):
            if isinstance(tensor, torch.Tensor):
                seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def divisor_spread(division: RecordedOp, ran: list[RecordedOp]) -> str | None:
    """The spread (std, var, norm) the loss code's recorded ``division`` divided by, read from the records ``ran``
    before it (divisor.py's :func:`recorded_spread`): at an event only, once its producer is claimed."""

    def made_by(value: Any) -> tuple[str, tuple[Any, ...], dict[str, Any], int] | None:
        key = record_key(value)
        if key is None:
            return None
        for op in reversed(ran):
            outputs = [record_key(out) for out in tree_leaves(op.out)]
            if key in outputs:  # (which output: std_mean's first is a std, its second a mean)
                return str(op.func), op.args, op.kwargs, outputs.index(key)
        return None

    return recorded_spread(str(division.func), division.args, made_by)
