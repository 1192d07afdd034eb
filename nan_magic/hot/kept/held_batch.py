"""A non-finite batch that entered a watched model, held until its step shows whether the program handled it.

PRODUCT.md: a non-finite value in a tensor entering a watched model is an event, and it is *benign* when the
program handles it: a tabular model that imputes its NaN-coded missing values in its own forward
(``torch.where(isnan(x), fill, x)``, ``x.nan_to_num()``) before any arithmetic. The watch cannot tell that as the
batch enters (the model's first op may read it with ``isnan``), so the batch's finding is held here, made as it
is today (its op and line where loop code made it), and the step decides:

* anything else of the step goes non-finite (a module's output, the loss, a gradient into the outputs, a
  parameter gradient, the step's parameters): the held finding is the report, exactly today's for a NaN batch
  (:meth:`HeldBatch.release`: by the producer rule where a call passes a non-finite value on, and by
  lifecycle/events.py before any other finding whose report is not benign; a deliberate infinity of the step, a
  causal mask, leaves it held);
* the step ends with all of that finite: the batch was handled, a benign event (:meth:`HeldBatch.settle` as the
  step closes, or at the deferred check that reads its parameters; recorded by lifecycle/events.py). A batch of
  -inf, no NaN, was handled only where the model opened it into a mask in place (a static KV cache's bias): any
  other is released then, the event it was as it entered.

Nothing is held, asked or read on a step whose batch is finite: the holder is only reached from the judgement of a
non-finite record (the step cycle and the deferred check read one attribute a step, inlined).
"""

from __future__ import annotations

import dis
import math
import numbers
import sys
import types
from collections.abc import Callable

import torch

from nan_magic.errors.exceptions import NonFiniteError
from nan_magic.errors.frames import is_library_code, is_library_file
from nan_magic.hot.kept.finding import Finding

__all__ = ["HeldBatch", "nonfinite_beside", "raised_by_a_raise_statement"]

_RAISE = dis.opmap["RAISE_VARARGS"]
_SUBSCRIPT = dis.opmap.get("BINARY_SUBSCR", -1)  # (3.14: a BINARY_OP)


class HeldBatch:
    """The step's first non-finite batch (a data finding), or None: see the module docstring.

    ``step()``: the step an event now belongs to (the report's, wherever in the step it is raised); ``emit``: the
    watch's way in for an event (lifecycle/events.py); ``handled``: records a handled batch's benign event there.
    """

    __slots__ = ("_emit", "_handled", "_opened", "finding", "released", "step")

    def __init__(
        self, step: Callable[[], int], emit: Callable[[Finding], None], handled: Callable[[Finding], None],
        opened: Callable[[object], bool] = lambda _record: False,
    ) -> None:
        self.step = step
        self._emit = emit
        self._handled = handled
        # Whether a held -inf batch (no NaN) was opened into a mask in place (localize/ops/masks.py): only then
        # was it handled; NaN is handled by the step's finite values alone.
        self._opened = opened
        #: The held data finding (its record's status ``"benign"`` while held, so no check judges it again).
        self.finding: Finding | None = None
        #: The finding being released as an event, while it is emitted: the batch's, whatever op the op tracer
        #: claimed since (lifecycle/events.py).
        self.released: Finding | None = None

    def hold(self, finding: Finding) -> None:
        """Hold ``finding`` (a batch's, judged non-finite as it entered) for its step; the step's first stays."""
        if self.finding is not None:
            return
        if finding.step is None:
            finding.step = self.step()  # (the optimizer's post-hook, where it may be raised, counts the step done)
        if finding.frame is None and finding.source is None:
            # Raised where it was judged, the report's %debug opened at the user's line running then (the model
            # call as the batch entered; the deferred check's ``opt.step()``, or the model call where the check
            # ran as it returned). Raised later in the step (a parameter gradient at ``opt.step()``), it opens
            # at that line still: the frame, as it stands now, is the producer's.
            frame = sys._getframe(1)
            while frame is not None and is_library_code(frame.f_code):
                frame = frame.f_back  # type: ignore[assignment]
            if frame is not None:
                finding.frame, finding.frame_position = frame, (frame.f_lasti, frame.f_lineno)
        if finding.record is not None:
            finding.record.status = "benign"  # held: the deferred check's later reads of the step pass it by
        self.finding = finding

    def take(self) -> Finding | None:
        """The held finding, now the step's event (its record judged as any again), or None."""
        finding, self.finding = self.finding, None
        if finding is not None and finding.record is not None:
            finding.record.status = "ok"
        return finding

    def release(self) -> bool:
        """A value of the step went non-finite: the held batch is its event, emitted (raised, in ``raise`` mode);
        whether one was held."""
        finding = self.take()
        if finding is None:
            return False
        self.released = finding
        try:
            self._emit(finding)
        finally:
            self.released = None  # (asked only during its emit: no tensor or frame kept past it)
        return True

    def explain(self, exc: BaseException) -> NonFiniteError | None:
        """The user's code raised ``exc`` in the step (an op that raises on the NaN): the held batch's error, if one
        is held. Not where the user's own ``raise`` statement (or ``assert``) raised it, nor where it ends an iteration
        (``next(batches)`` past the last batch of an evaluation loop), *and* no value the raising code holds is
        non-finite but the batch (:func:`nonfinite_beside`): their decision (an early stop, a time budget, the data
        running out), left to reach their ``except`` as it would unwatched; the batch was handled as far as the step
        ran (settled: a benign event). A value the watch judges later in the step (a loss before its backward, a
        metric, a value inside a module's own code) is what their check may have raised on: a NaN loss, or the
        model's guard on the batch's NaN, is the batch's event, not a handled batch."""
        finding = self.finding
        if finding is None:
            return None
        if ((isinstance(exc, (StopIteration, StopAsyncIteration)) or raised_by_a_raise_statement(exc))
                and not nonfinite_beside(exc, finding.bad)):
            self.settle()
            return None
        try:
            self.release()
        except NonFiniteError as error:
            return error
        return None

    def settle(self) -> None:
        """The step ended finite: the held batch, if any, was handled, a benign event (its record stays benign: a
        later read of the step, the watch's exit, passes it by)."""
        finding = self.finding
        record = finding.record if finding is not None else None
        if record is not None and "nan" not in record.kinds and not self._opened(record):
            self.release()  # an infinity entering, no mask even as its consumer read it: the event it was
            return
        self.finding = None
        if finding is not None:
            self._handled(finding)


def raised_by_a_raise_statement(exc: BaseException, depth: int = 0) -> bool:
    """Whether ``exc`` was raised by a ``raise`` statement (an ``assert`` compiles to one) in the user's code: the
    innermost entry of its traceback is a user's frame stopped at that instruction, not at a call into an op that
    raised (``torch.multinomial`` on NaN probabilities stops at the call) nor inside library code; and so was the
    error it was raised from or while handling, if any and shown (``raise SamplingError() from error`` is the op's;
    after ``from None`` there is none), or that error is a ``KeyError`` of a subscript in the user's code (a
    ``cfg["max_steps"]`` lookup: no op raises one)."""
    chained = exc.__cause__ if exc.__cause__ is not None or exc.__suppress_context__ else exc.__context__
    if chained is not None and (depth > 8 or not (raised_by_a_raise_statement(chained, depth + 1)
                                                  or _stopped_at(chained, _SUBSCRIPT, KeyError))):
        return False
    return _stopped_at(exc, _RAISE, BaseException)


def _stopped_at(exc: BaseException, opcode: int, kind: type[BaseException]) -> bool:
    """Whether ``exc`` is a ``kind`` whose traceback's innermost entry is a user's frame stopped at ``opcode``."""
    tb = exc.__traceback__
    if tb is None or not isinstance(exc, kind):
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if is_library_code(code):
        return False
    lasti = tb.tb_lasti
    return 0 <= lasti < len(code.co_code) and code.co_code[lasti] == opcode


def nonfinite_beside(exc: BaseException, batch: torch.Tensor | None) -> bool:
    """Whether a local of a user's frame in ``exc``'s traceback (the loop's, a helper's, a model's own ``forward``)
    holds a NaN, as a floating tensor or a number other than ``batch`` and its views (sharing its storage), itself or
    as an item of a list, tuple or dict it holds (a loss history): the value the user's own check may have raised on.
    Only a NaN: a held batch is a NaN batch, and what it makes is NaN, where an infinity beside it is the user's own
    sentinel (``best = float("inf")``, ``math.inf``, a causal mask's -inf). Asked only as a step with a held batch
    raises. (A value checked where no local holds it, ``if torch.isnan(loss_fn(model(x), x)): raise``, is not seen:
    that batch is settled as handled.)"""
    storage = _storage_of(batch) if batch is not None else None
    # (a loss, a metric, an activation the user's guard reads: a few times the batch at most; a NaN-coded dataset the
    # loop holds, as a tensor, an array or a Dataset's attribute, is many batches, and its NaN is no evidence)
    largest = _WIDEST * batch.numel() if batch is not None else None
    tb = exc.__traceback__
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
        if is_library_code(frame.f_code):
            continue
        for value in _with_items(list(frame.f_locals.values())):
            if type(value).__name__ == "ndarray" and getattr(value, "dtype", None) is not None:
                try:  # (a numpy array, ``loss.numpy()``: read through a tensor that shares its memory)
                    value = torch.as_tensor(value)
                except Exception:
                    continue
            if isinstance(value, numbers.Real) and not isinstance(value, int):  # (a numpy float too: loss.numpy())
                if math.isnan(float(value)):
                    return True
            elif (isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
                  and value.layout is torch.strided and value.device.type != "meta"
                  and (storage is None or _storage_of(value) != storage)
                  and (largest is None or value.numel() <= largest)):
                try:
                    with torch.no_grad():
                        if bool(torch.isnan(value.detach()).any()):
                            return True
                except Exception:
                    continue
    return False


#: How many times the batch's elements a value the user's check reads may hold (a hidden layer's activations).
_WIDEST = 16


def _with_items(values: list[object]) -> list[object]:
    """``values`` and, one level down, the items of those that are lists, tuples or dicts and the attributes of
    those that are instances of a class (a running loss on ``self``, an ``AverageMeter``'s ``avg``); not of a
    module, class or function (``np.nan`` is an attribute of numpy, not a value of the user's)."""
    out = list(values)
    for value in values:
        if isinstance(value, (list, tuple)):
            out.extend(value)
        elif isinstance(value, dict):
            out.extend(value.values())
        elif (not isinstance(value, _NOT_INSTANCES) and isinstance(attributes := getattr(value, "__dict__", None), dict)
              and len(attributes) <= _MOST_ATTRIBUTES and _users_class(type(value))):
            out.extend(attributes.values())
    return out


def _users_class(cls: type) -> bool:
    """Whether ``cls`` is defined in the user's code (a notebook's cell, their script), not a library's: a
    DataLoader's iterator holds the whole dataset, NaN-coded samples and all, as an attribute."""
    filename = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return filename is None or not is_library_file(filename)


#: What holds attributes that are no values of the user's loop (``np.nan``, a class's constants).
_NOT_INSTANCES = (types.ModuleType, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType)
#: An object with more attributes than this is no meter or trainer state (bounded: asked at an exception exit).
_MOST_ATTRIBUTES = 256


def _storage_of(tensor: torch.Tensor) -> tuple[str, int] | None:
    """The device and address of ``tensor``'s storage (a view shares its base's), or None where it has none."""
    try:
        return str(tensor.device), tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
