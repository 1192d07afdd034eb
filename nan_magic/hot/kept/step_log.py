"""The step's log: the calls of the current step in order, probes read in one transfer, consumers found.

Hooks append records (call_records.py) and do nothing else on the fast path. The log keeps them in order,
bounded, reads every pending probe in one transfer at the deferred check, and maps tensors to their records
so that a tensor's consumer, and a gradient's producer, can be found.
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
from collections import deque
from typing import Any

import torch

from nan_magic.hot.kept.call_records import (
    Alias,
    Call,
    KnownFinite,
    TensorRecord,
    consumer_of,
    gradient_label,
)
from nan_magic.hot.kept.finding import record_ref
from nan_magic.hot.reads import (
    finite_max,
    probe_kinds,
    read_scalars,
)
from nan_magic.hot.watched.targets import ModuleInfo
from nan_magic.records import LayerCall, Phase, TensorRef, TensorRole

__all__ = ["StepLog"]

#: A returned call's place in the order calls returned (no Python call per call, as a lambda would be).
_RETURN_ORDER = operator.attrgetter("finished")

#: A finite record's kinds (resolve sets them inline).
_NONE: frozenset[str] = frozenset()

#: ``(finfo(dtype).max / |x|, module, dtype)``: how far a value is from overflowing.
Headroom = tuple[float, str | None, str]


class StepLog:
    """Calls of the current step, and the identity map used to find consumers.

    Bounded: at most ``max_calls`` calls are kept (the oldest are dropped and
    counted), so a step of a huge model cannot grow memory without limit.
    """

    def __init__(self, max_calls: int, hold_probes: bool) -> None:
        #: Whether records keep their probes on the device until :meth:`resolve` (the deferred mode, timing.py).
        self.hold_probes = hold_probes
        self._calls: deque[Call] = deque(maxlen=max_calls)
        # Gradients found finite, not yet made into calls (:meth:`finite_gradient`),
        # and those gradient tensors by id, with their version then.
        self._finite_gradients: deque[_FiniteGradient] = deque(maxlen=max_calls)
        self._finite_ids: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        # Free places left in each deque before an append drops its oldest (read, not len(): every call and gradient).
        self._max = self._calls_room = self._gradients_room = max_calls
        self.dropped = 0
        self.count = 0
        self.finished_count = 0
        #: The top-level model calls of the current training step so far (StepCycle.forward_started). Not reset by
        #: :meth:`clear`: a step of gradient accumulation clears the log at each micro-batch's model call.
        self.model_calls = 0
        self._by_id: dict[int, TensorRecord] = {}
        self._aliases: dict[int, Alias] = {}
        # Outputs of pass-throughs left to their parent's check (transparent.py), by id.
        self._unseen: dict[int, weakref.ref[torch.Tensor]] = {}
        # (phase, dtype) -> (largest finite |value| this step, its call), kept as probes are read (:meth:`summary`).
        self._largest: dict[tuple[Phase, torch.dtype], tuple[float, Call]] = {}
        #: The autograd sequence number when the last top-level forward returned: nodes numbered from it on
        #: belong to the code outside the modules (loss_region.py). Written by the forward hooks, read by the
        #: gradient checks. :meth:`clear` keeps it: a step is cleared as the next top-level forward starts,
        #: and until that forward returns, the last one that did still marks where the outside code began.
        self.last_forward_seq = 0

    def clear(self) -> None:
        """Forget the step's calls, freeing them now rather than at Python's next garbage collection.

        Calls and records refer to each other (a call to its outputs and
        back, a consumer to its inputs' records and back, a record to the one
        it returned again): left as they are, every step leaves a few
        objects per module call in reference cycles, for the collector to
        find (on ResNet-18, 0.65 ms of its 43 ms step went to collections;
        0.3 ms without the cycles, measured with ``gc.callbacks``). Cutting
        the call-side edges lets reference counting free them. A record still
        reachable afterwards (from the gradient hook of a tensor kept alive)
        keeps its call, consumers and enclosing records.
        """
        for call in self._calls:
            for record in call.outputs:
                record.inner = None
            call.outputs = []
            call.inputs = []
            call.held = None
        # (Each cleared only where it holds anything: a step leaves most of them empty, and a clear is a call; a
        # dict, private to the log, is replaced instead: no call.)
        if self._calls:
            self._calls.clear()
        if self._finite_gradients:
            self._finite_gradients.clear()
        if self._finite_ids:
            self._finite_ids = {}
        if self._by_id:
            self._by_id = {}
        if self._aliases:
            self._aliases = {}
        if self._unseen:
            self._unseen = {}
        if self._largest:
            self._largest = {}
        self._calls_room = self._gradients_room = self._max
        self.dropped = 0
        self.count = 0
        self.finished_count = 0

    @property
    def calls(self) -> deque[Call]:
        """The step's calls, oldest first by creation (at most ``max_calls``)."""
        if self._finite_gradients:
            self._make_gradient_calls()
        return self._calls

    def finite_gradient(self, record: TensorRecord, grad: torch.Tensor) -> None:
        """Note that the gradient of ``record``'s tensor was found finite (the backward hot path).

        Made into a backward call with its record only when the calls are
        read (:attr:`calls`): for a report, at most once per step. Until
        then it is a tuple, which in a 43 ms ResNet-18 step saves about a
        millisecond over building its call and record in the hook.
        """
        if self._gradients_room:
            self._gradients_room -= 1
        else:
            self.dropped += 1
        self._finite_gradients.append((self.count, self.finished_count, record, grad.dtype, grad.shape))
        try:  # (version_of, inlined: every gradient found finite)
            version = grad._version
        except RuntimeError:  # an inference tensor has none
            version = 0
        self._finite_ids[id(grad)] = (weakref.ref(grad), version)
        self.count += 1
        self.finished_count += 1

    def gradient_seen(self, grad: torch.Tensor) -> tuple[bool, bool]:
        """``(recorded, known finite)`` of a gradient a hook receives: whether this very tensor has a record this step
        (:meth:`lookup`), and whether it was found finite already, unchanged since.

        Autograd hands one gradient tensor to several places (an addition
        passes it to both of its inputs): it is summed once. (One look-up of
        its id for both: every gradient of a per-module step asks.)
        """
        key = id(grad)
        record = self._by_id.get(key)
        if record is not None and record.ref() is grad:
            return True, False
        known = self._finite_ids.get(key) if self._finite_ids else None  # (none yet: the step's first gradient)
        if known is None or known[0]() is not grad:
            return False, False
        try:  # (version_of, inlined)
            version = grad._version
        except RuntimeError:  # an inference tensor has none
            version = 0
        return False, known[1] == version

    def _make_gradient_calls(self) -> None:
        """The backward calls of the gradients noted by :meth:`finite_gradient`, merged in creation order."""
        made = []
        for index, finished, target, dtype, shape in self._finite_gradients:
            consumer = consumer_of(target)
            call = Call(index, Phase.BACKWARD, consumer.info if consumer is not None else None, None, None)
            call.consumer, call.finished = consumer, finished
            call.outputs.append(TensorRecord.finite(gradient_label(target, consumer), dtype, tuple(shape), call))
            made.append(call)
        self._finite_gradients.clear()
        self._gradients_room = self._max
        limit = self._calls.maxlen
        merged = sorted([*self._calls, *made], key=lambda call: call.index)
        if limit is not None and len(merged) > limit:
            # The oldest go, as in :meth:`new_call`.
            self.dropped += len(merged) - limit
            merged = merged[len(merged) - limit :]
        self._calls = deque(merged, maxlen=limit)
        self._calls_room = self._max - len(merged)

    def finish(self, call: Call) -> None:
        """Mark a call as returned: children return before their parent."""
        call.finished = self.finished_count
        self.finished_count += 1

    def any_kinds(self) -> bool:
        """Whether a record of the step's calls shows a non-finite value (the gradients noted finite hold none)."""
        for call in self._calls:  # (loops, no generator: a Python call per item)
            for record in call.outputs:
                if record.kinds:
                    return True
        return False

    def finished(self) -> list[Call]:
        """Returned calls in the order they returned (the order producers are judged in)."""
        return sorted([call for call in self.calls if call.finished >= 0], key=_RETURN_ORDER)

    def new_call(self, phase: Phase, info: ModuleInfo | None, module: Any, parent: Call | None) -> Call:
        call = Call(self.count, phase, info, module, parent)
        call.model_call = self.model_calls
        self.count += 1
        if self._calls_room:
            self._calls_room -= 1
        else:
            self.dropped += 1
        self._calls.append(call)
        return call

    def record_output(
        self, call: Call, path: str | TensorRef, tensor: torch.Tensor, ranged: bool = True
    ) -> TensorRecord:
        """Probe and record a call's output; ``ranged=False``: only its finiteness is needed."""
        key = id(tensor)
        inner = self._by_id.get(key)  # (lookup, inlined: every boundary tensor)
        if inner is not None and inner.ref() is not tensor:
            inner = None
        same = inner if inner is not None and inner.live() is not None else None
        record = TensorRecord(path, tensor, call, self.hold_probes, same, ranged)
        if inner is not None:
            inner.outer = record
            record.inner = inner
        call.outputs.append(record)
        self._by_id[key] = record
        # The step's largest finite |value| per phase and dtype, for summary(): noted as each probe is read, while the
        # record is in cache (a pass over every record at the step's end cost ~0.2 ms of ResNet-18's 43 ms step).
        if (record.ranged and record._probe is None and not record.kinds
                and (call.info is not None or call.phase is Phase.BACKWARD)):
            low, high = record.low, record.high
            value = high if high > -low else -low
            largest = self._largest.get(largest_key := (call.phase, record.dtype))
            if largest is None or value > largest[0]:
                self._largest[largest_key] = (value, call)
        return record

    def one_call(self, phase: Phase, info: ModuleInfo | None, module: Any, path: str | TensorRef,
                 tensor: torch.Tensor, ranged: bool = True) -> Call:
        """A call of one tensor made, recorded and returned (its record ``call.outputs[0]``) in one frame: new_call,
        record_output and finish inlined (``model(x)``'s data, the loss, a gradient: two calls fewer each)."""
        call = Call(self.count, phase, info, module, None)
        call.model_call, self.count = self.model_calls, self.count + 1
        if self._calls_room:
            self._calls_room -= 1
        else:
            self.dropped += 1
        self._calls.append(call)
        inner = self._by_id.get(key := id(tensor))
        if inner is not None and inner.ref() is not tensor:
            inner = None
        record = TensorRecord(path, tensor, call, self.hold_probes,
                              inner if inner is not None and inner.live() is not None else None, ranged)
        if inner is not None:
            inner.outer, record.inner = record, inner
        call.outputs.append(record)
        self._by_id[key] = record
        if (record._probe is None and record.ranged and not record.kinds
                and (info is not None or phase is Phase.BACKWARD)):
            value = record.high if record.high > -record.low else -record.low
            largest = self._largest.get(largest_key := (phase, record.dtype))
            if largest is None or value > largest[0]:
                self._largest[largest_key] = (value, call)
        call.finished, self.finished_count = self.finished_count, self.finished_count + 1
        return call

    def lookup(self, tensor: torch.Tensor) -> TensorRecord | None:
        """The record of a tensor seen earlier in this step, if it is that very tensor."""
        record = self._by_id.get(id(tensor))
        if record is not None and record.ref() is tensor:
            return record
        return None

    def alias(self, output: torch.Tensor, source: torch.Tensor, module: Any, rng_state: Any, bound: float,
              known: KnownFinite) -> None:
        """Let a passed-through call's output stand for the record of its input.

        ``known`` is what :meth:`known_finite` said of ``source`` when the
        call began; ``bound`` bounds the output's magnitude (from the
        input's range).
        """
        record, _low, _high, origin = known
        try:  # (version_of, inlined: every pass-through of a per-module step)
            version = source._version
        except RuntimeError:  # an inference tensor has none
            version = 0
        if version == origin.version:  # not written during the call
            self._aliases[id(output)] = Alias(output, record, module, source, origin, rng_state, bound)

    def alias_of(self, tensor: torch.Tensor) -> Alias | None:
        alias = self._aliases.get(id(tensor))
        return alias if alias is not None and alias.ref() is tensor else None

    def known_finite(self, tensor: torch.Tensor) -> KnownFinite | None:
        """``(record, low, high, origin)`` when the tensor is known finite and unchanged since; None otherwise.

        Known from its own read probe (``origin`` is then its record), or
        through the pass-throughs it came from (``origin`` is the alias it
        is the output of; ``record`` the record the chain goes back to).
        """
        record = self._by_id.get(id(tensor))  # (lookup, inlined)
        try:  # (version_of, inlined: every pass-through of a per-module step asks)
            version = tensor._version
        except RuntimeError:  # an inference tensor has none
            version = 0
        if record is not None and record.ref() is tensor:
            if record._probe is not None or record.kinds or not record.ranged or version != record.version:
                return None
            return record, record.low, record.high, record
        alias = self.alias_of(tensor) if self._aliases else None
        if alias is None or version != alias.version:
            return None
        return alias.record, -alias.bound, alias.bound, alias

    def unseen(self, output: torch.Tensor) -> None:
        """Note the output of a pass-through left to its parent's check: nothing stands for it yet."""
        self._unseen[id(output)] = weakref.ref(output)

    def is_unseen(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is such an output, not yet adopted (:meth:`adopt`)."""
        ref = self._unseen.get(id(tensor))
        return ref is not None and ref() is tensor

    def adopt(self, tensor: torch.Tensor) -> TensorRecord:
        """A record of an unseen output that a module consumes, belonging to no call.

        Probed like a gradient (a sum where it can answer, so usually with no
        range a pass-through could rely on), with no layer row: it exists so
        that the gradient flowing back into it names that module as its
        consumer.
        """
        del self._unseen[id(tensor)]
        record = TensorRecord("output", tensor, None, self.hold_probes, ranged=False)
        self._by_id[id(tensor)] = record
        return record

    def note_input(self, call: Call, path: str, argument: int | str, tensor: torch.Tensor) -> None:
        record = self._by_id.get(id(tensor))  # (lookup, inlined: every input of every checked call)
        if record is None or record.ref() is not tensor:
            alias = self.alias_of(tensor) if self._aliases else None  # (none on a tiered step: no call)
            record = alias.record if alias is not None else None
        if record is not None:
            record.consumers.append(call)
        try:  # (version_of, inlined)
            version = tensor._version
        except RuntimeError:  # an inference tensor has none
            version = 0
        call.inputs.append((path, argument, record, weakref.ref(tensor), version))

    def resolve(self, extra: list[torch.Tensor] | None = None) -> list[float]:
        """Read every pending probe, and ``extra`` scalars, in one device-to-host copy.

        Returns the values of ``extra``. This is the deferred mode's one host
        synchronisation per step.
        """
        # (The calls property read only where gradients wait to be made calls; ``_probe`` read directly: the
        # ``pending`` property is a Python call per record. Every step's check.)
        calls = self._calls if not self._finite_gradients else self.calls
        pending = [record for call in calls for record in call.outputs if record._probe is not None]
        extra = extra or []
        scalars = [value for record in pending for value in record._probe]  # type: ignore[union-attr]
        values = read_scalars(scalars + extra) if scalars or extra else []
        largest = self._largest
        for position, record in enumerate(pending):
            # (set_probe, and the largest value noted as record_output notes it: every deferred boundary tensor)
            record.low, record.high = low, high = values[2 * position], values[2 * position + 1]
            record._probe = None
            if not -math.inf < low <= high < math.inf:
                record.kinds = probe_kinds(low, high)
                continue
            record.kinds = _NONE
            call = record.call
            if call is not None and (call.info is not None or call.phase is Phase.BACKWARD):
                value = high if high > -low else -low
                noted = largest.get(key := (call.phase, record.dtype))
                if noted is None or value > noted[0]:
                    largest[key] = (value, call)
        return values[len(scalars):]

    def layer_calls(self, limit: int) -> tuple[tuple[LayerCall, ...], int]:
        """Frozen per-layer rows for a report, in the order calls returned.

        Completion order is the order the producer rule judges in: a module's
        children come before it, and every row after the producer's ran after
        it. Calls still running (the producer's parents) come last.
        """
        rows: list[LayerCall] = []
        running = [call for call in self.calls if call.finished < 0]
        for call in self.finished() + running:
            # A data call's records are the batch's arguments, every other call's its outputs
            # (a gradient, the loss, a value passed to a child carry their own reference).
            role = TensorRole.INPUT if call.phase is Phase.DATA else TensorRole.MODULE_OUTPUT
            for record in _own_rows(call):
                stats = record.stats()
                # A value the check that stopped the step never judged (the deferred check stops at the loss, the
                # backward's gradients after it unjudged) is no "ok" where it holds non-finite values: it came
                # after the producer, which is first by the rule, so it carried them on.
                # (A count of None is a kind the probe saw and did not count: a freed gradient's "? nan".)
                unjudged = (
                    record.status == "ok"
                    and stats is not None
                    and (bool(stats.kinds) or None in (stats.nan, stats.posinf, stats.neginf))
                )
                rows.append(
                    LayerCall(
                        index=call.index,
                        phase=call.phase,
                        module=call.name,
                        module_type=call.module_type,
                        stats=stats,
                        status="propagated" if unjudged else record.status,
                        tensor=record_ref(record, role),
                        path=call.info.path if call.info is not None else None,
                        model=call.info.model if call.info is not None else None,
                    )
                )
        cut = max(0, len(rows) - limit)
        return tuple(rows[cut:]), cut + self.dropped

    def module_magnitudes(self) -> tuple[tuple[str, float, str, tuple[str, ...]], ...]:
        """``(module, largest finite |output|, dtype, module's path)`` of each module called in forward this step.

        Read at the end of a per-module step only (step_cycle.py): a few
        floats per module for the history, no tensors kept. A module
        called several times keeps its largest value; outputs with no range
        (non-finite, or only summed) are left out.
        """
        largest: dict[str, tuple[float, str, tuple[str, ...]]] = {}
        for call in self._calls:
            info = call.info
            if call.phase is not Phase.FORWARD or info is None:
                continue
            name = info.name
            for record in call.outputs:
                if record.ranged and record._probe is None and not record.kinds and record.dtype.is_floating_point:
                    value = record.high if record.high > -record.low else -record.low  # (no max(): a call each)
                    if name not in largest or value > largest[name][0]:
                        largest[name] = (value, _dtype_name(record.dtype), info.path)
        # (A list, not a generator: each item of a generator is a Python call.)
        return tuple([(name, value, dtype, path) for name, (value, dtype, path) in largest.items()])

    def summary(self) -> tuple[float | None, float | None, Headroom | None, Headroom | None]:
        """What the step's read probes say, from the largest values noted as they were read.

        Returns ``(absmax, data absmax, headroom, gradient headroom)``:
        the largest finite |value| of the forward outputs and of the tensors
        entering the model, and the smallest ``finfo(dtype).max / |x|`` (how
        close to overflow) over forward outputs and over gradients, each as
        ``(ratio, module, dtype)``.
        """
        absmax = data_absmax = None
        # (The two phases' headrooms in locals, not a dict by phase: no get() per entry, every step.)
        forward: Headroom | None = None
        backward: Headroom | None = None
        for (phase, dtype), (value, call) in self._largest.items():
            if phase is Phase.DATA:
                data_absmax = value if data_absmax is None or value > data_absmax else data_absmax
                continue
            if phase is Phase.FORWARD and (absmax is None or value > absmax):
                absmax = value
            if value > 0 and (phase is Phase.FORWARD or phase is Phase.BACKWARD):
                ratio = finite_max(dtype) / value
                best = forward if phase is Phase.FORWARD else backward
                if best is None or ratio < best[0]:
                    made = (ratio, call.info.name if call.info is not None else None, _dtype_name(dtype))
                    if phase is Phase.FORWARD:
                        forward = made
                    else:
                        backward = made
        return absmax, data_absmax, forward, backward


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32`` (cached: a per-module step names one for each module call)."""
    return str(dtype).removeprefix("torch.")


#: ``(call index, finished index, record of the forward tensor, gradient dtype, gradient shape)``
_FiniteGradient = tuple[int, int, TensorRecord, torch.dtype, torch.Size]


def _own_rows(call: Call) -> list[TensorRecord]:
    """``call``'s records, each tensor once: the call's own output, where the producer rule also recorded it
    as the value its code passed to a child (the child returned it: ``return self.proj(h)``)."""
    outputs = [record.ref() for record in call.outputs if not isinstance(record.path, TensorRef)]
    return [
        record for record in call.outputs
        if not isinstance(record.path, TensorRef) or (tensor := record.ref()) is None
        or not any(tensor is output for output in outputs)
    ]

