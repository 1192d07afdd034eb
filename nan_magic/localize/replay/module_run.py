"""Re-run one module call under op-level tracing to name the producer op.

The per-module watch finds *which module* first produced a non-finite value
at the cost of one reduction per call. To name the op and the line inside it,
the watch keeps that call's inputs and the RNG state from just before it, and
:func:`replay_module` runs the module again on them under an
:class:`~nan_magic.localize.ops.tracer.OpTracer`: same inputs, same dropout masks,
same kernels. The replay leaves no trace: it runs under ``no_grad`` on copies
of the inputs, buffers are swapped for copies during the run, a parameter
that the forward writes in place is restored bit for bit, and the RNG state
is put back to what it was before the replay.

A backward producer is replayed the same way, later: the gradient hook that
finds a non-finite gradient runs inside autograd, after the consumer's
forward returned. The watch keeps that call's arguments (held.py, weakly
unless autograd keeps them anyway) and :func:`replay_backward` runs the
forward again with gradients, then its backward, so the tracer names the
backward op, its autograd node and the forward line that created the node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from nan_magic.distributed.ranks import qualified
from nan_magic.hot.kept.call_records import Call
from nan_magic.hot.kept.held import HeldArguments, Regenerate
from nan_magic.hot.kept.rng import AutocastState, RngState, generators_at
from nan_magic.hot.reads import iter_tensors, relevant_kinds
from nan_magic.hot.stats import kinds_of
from nan_magic.localize.ops.origins import OpFinding
from nan_magic.localize.ops.reached import reached_failure
from nan_magic.localize.ops.sources import Chain
from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.localize.replay.line_replay import NOT_REACHED, LineStop, line_stop_at, nodes_made
from nan_magic.localize.replay.untouched import arguments_untouched, untouched
from nan_magic.records import Note, Phase
from nan_magic.tensor_refs import op_function

__all__ = [
    "ANOMALY_STOP", "ReplayResult", "copy_tensors", "enclosing_output", "map_tensors", "parameters_at", "recompute",
    "replay_backward", "replay_module", "run_again", "submodule_names", "swapped_buffers",
]


@dataclass(frozen=True)
class ReplayResult:
    """What a replay found: the producer op inside the module, or why there is none."""

    finding: OpFinding | None
    #: Whether the replay made a non-finite value again (then ``finding`` is set).
    reproduced: bool
    #: Why there is no finding; None when there is one.
    note: Note | None = None
    #: The output was non-finite but no op inside made it: its inputs, parameters, buffers or scalar arguments
    #: (``masked_fill(mask, -inf)``) already held that kind.
    held_by_inputs: bool = False
    #: The tracer's copies of the producer op's output, then its tensor inputs, by name.
    tensors: tuple[tuple[str, torch.Tensor], ...] = ()
    #: The user's frame that ran the producing op in the replay, at that line with the locals it left
    #: (line_state.py), for ``%debug``; None without a finding.
    frame: FrameType | None = None
    #: Modules (qualified names) whose code made or carried on a deliberate infinity during the replay.
    benign_modules: frozenset[str | None] = frozenset()
    #: What the report says of ``frame`` where it is a replay of a backward op's forward line, or why there is none.
    debug_note: Note | None = None
    #: The user's frames from the one that called the check to ``frame``, as each called the next (the replayed
    #: forwards between: the traceback lacks them, frames.end_at_producer).
    calls: Chain = ()


def replay_module(
    module: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    rng_state: RngState | None,
    kinds: frozenset[str] = frozenset({"nan", "inf"}),
    module_name: str = "",
    autocast: AutocastState | None = None,
    saving: bool = False,
) -> ReplayResult:
    """Run ``module(*args, **kwargs)`` again under an :class:`OpTracer`: the producer op, or why there is none.

    ``args``/``kwargs`` are what ``module.__call__`` got (so the user's pre-hooks see them again), copied first: a
    forward that works in place on its input must not change the user's tensors twice. ``rng_state`` is
    :func:`capture_rng_state` from right before the original call, so dropout draws the same mask (None for a
    module that draws no random numbers: ``deterministic.draws_no_random``); ``autocast`` is
    :func:`capture_autocast` of the original call, for a replay outside the user's autocast block;
    ``module_name`` prefixes the submodules the finding names. ``saving`` turns gradients on, as a training call
    ran: autograd then keeps the inputs of the ops it differentiates (a masked max's input, which a later op names:
    ops/origins.Picked), where a no_grad replay frees each as a line ends.

    Call it where the original call ran (inside the watch's hook): autocast and the module's train/eval mode
    must be the same. Without ``saving`` the replay runs under ``no_grad``; a module that takes another path
    then (``nn.TransformerEncoderLayer``'s fused inference path) may compute differently.
    """
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        args, kwargs = copy_tensors(tuple(args), copies), copy_tensors(dict(kwargs), copies)
    output: Any = None
    failure: Exception | None = None
    returned = False  # (the forward returned: a failure after it is our own reading of its output, not the user's)
    # The watch judged the forward's own output (its global hook runs first), not a user's hook's (zeroing a -inf).
    raw: list[Any] = []  # (the outermost call of a module that calls itself returns last)
    def keep_raw(sub: nn.Module, _args: Any, result: Any) -> None:
        if sub is module:
            raw[:] = [result]

    # The replay runs to its end, so that the producing line ends and %debug shows the locals it left
    # (line_state.py). Its output is claimed as ops=True claims a module's: the op whose value reached it, not an
    # overflow the call's own code absorbed before it (``tanh(exp(100 * h))``); else the first op that made one.
    drawn: list[torch.Generator] = []  # (generators it drew from whose state was not kept: hot/kept/generators.py)
    with _isolated(module, module_name, rng_state, kinds, autocast=autocast, drawn=drawn) as tracer, \
            arguments_untouched(args, kwargs) as guard, register_module_forward_hook(keep_raw):
        tracer.at_boundary = tracer.witnesses.hold = True  # (the origins' operands kept to the claim: histograms)
        try:
            with torch.set_grad_enabled(saving), tracer:
                output = module(*args, **kwargs)
                returned = True
                output = raw[0] if raw else output
                tracer.claim_first([tensor for _path, tensor in iter_tensors(output, attributes=True)])
        except Exception as error:
            failure = error
        if failure is None or returned:
            tracer.claim_earliest()
        elif tracer.finding is None and (reached := reached_failure(tracer, failure)) is not None:
            # (a NaN it made and discarded before the user's own error is no cause of it: reached.py)
            tracer.claim_origin(reached)
        tracer.witnesses.release()
    if guard.changed:
        # The call changed an object it was given (a KV cache it appended to): the replay began from that object
        # as the call left it, not as the call found it; what it found is not the call's (producer.py replays an
        # enclosing call instead).
        return ReplayResult(finding=None, reproduced=False, note=Note.of("replay-arguments-changed",
                                                                         module=module_name))
    benign = frozenset(tracer.benign_modules)
    if drawn:
        # It drew from a generator of the user's whose state at the call was not kept (a global's): other numbers,
        # so what it made is not what the call made.
        return ReplayResult(finding=None, reproduced=False, note=Note.of("replay-generator-not-kept",
                                                                         module=module_name), benign_modules=benign)
    if tracer.finding is not None:
        frame = tracer.frame_of(tracer.finding)[0]  # the replay's, its locals the replay's: the report says so
        return ReplayResult(
            finding=tracer.finding, reproduced=True, tensors=tracer.producer_tensors, frame=frame,
            benign_modules=benign, debug_note=Note.of("debug-in-replay", module=module_name) if frame else None,
            calls=tracer.witnesses.calls_of(tracer.finding),
        )
    if failure is not None:
        note = Note.of("replay-raised", module=module_name, error=type(failure).__name__, message=str(failure))
    elif any(relevant_kinds(kinds_of(t), frozenset(kinds)) for _, t in iter_tensors(output, attributes=True)):
        note = Note.of("replay-held", module=module_name)
        return ReplayResult(finding=None, reproduced=False, note=note, held_by_inputs=True, benign_modules=benign)
    else:
        note = Note.of("replay-finite", module=module_name)
    return ReplayResult(finding=None, reproduced=False, note=note, benign_modules=benign)


def submodule_names(module: nn.Module, module_name: str) -> dict[int, str]:
    """The name a replay of ``module`` (called ``module_name``) gives each of its modules, by ``id``."""
    return {id(sub): qualified(module_name, name) for name, sub in module.named_modules()}


def map_tensors(function: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with each tensor in its tuples, named tuples, lists and dicts mapped by ``function``.

    What ``tree_map`` does for the shapes a call's arguments take, at a
    fraction of its cost (the loss recorder maps every recorded op's).
    """
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(function, item) for item in value))
    if type(value) in (tuple, list):
        return type(value)(map_tensors(function, item) for item in value)
    if type(value) is dict:
        return {key: map_tensors(function, item) for key, item in value.items()}
    return value


def copy_tensors(value: Any, copies: dict[int, torch.Tensor]) -> Any:
    """Copy the tensors in tuples, lists and dicts; one copy per tensor object."""
    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.detach().clone()
        return copies[id(tensor)]

    return map_tensors(copy, value)


@contextlib.contextmanager
def swapped_buffers(module: nn.Module, before: Mapping[int, torch.Tensor] | None = None) -> Iterator[None]:
    """Give every submodule copies of its buffers for the duration.

    BatchNorm updates its running statistics during the replay; the originals
    are never touched (not even their version counters, which autograd checks
    for the user's pending backward). A buffer shared by several modules
    gets one shared copy. ``before`` maps ``id(buffer)`` to its value before
    the replayed call, where the call changed it (replay/tiered/step.py); other
    buffers are copied as they are now.
    """
    copies: dict[int, torch.Tensor] = {}
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for sub in module.modules():
            for name, buffer in list(sub._buffers.items()):
                if buffer is None:
                    continue
                if id(buffer) not in copies:
                    copies[id(buffer)] = (before or {}).get(id(buffer), buffer).detach().clone()
                swapped.append((sub, name, buffer))
                sub._buffers[name] = copies[id(buffer)]
        yield
    finally:
        for sub, name, buffer in swapped:
            sub._buffers[name] = buffer


@contextlib.contextmanager
def parameters_at(values: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Parameters as they were before a replayed call that wrote them in place (a max-norm renorm), for the duration.

    Written through ``.data``, as they are put back after: their version counters, which autograd checks for the
    user's pending backward, do not move. Enter it outside :func:`~nan_magic.localize.replay.untouched.untouched`,
    whose guard puts back what the replay writes (these values) before this puts back the values the call left.
    """
    now: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for parameter, before in values:
                now.append((parameter, parameter.detach().clone()))
                parameter.data.copy_(before)
        yield
    finally:
        with torch.no_grad():
            for parameter, value in now:
                parameter.data.copy_(value)


def replay_backward(
    module: nn.Module,
    held: HeldArguments,
    target: Sequence[Any],
    *,
    rng_state: RngState | None,
    regenerate: Regenerate | None = None,
    kinds: frozenset[str] = frozenset({"nan", "inf"}),
    module_name: str = "",
    autocast: AutocastState | None = None,
    anomaly: bool = False,
) -> ReplayResult:
    """Re-run a call's forward with gradients, then its backward, to name a backward op.

    Called from the gradient hook that found the non-finite gradient of the
    call's input whose records (the tensor's, and those of calls that
    returned it again) are ``target``. The forward runs again on
    copies of the call's arguments (a freed one recomputed by
    ``regenerate``), with the same RNG state; then ``autograd.grad``
    computes the gradient of the target's copy only, so no ``.grad`` of the
    user's parameters is touched. The gradient flowing into the outputs is
    all ones: the real one is not kept (keeping it would retain a tensor per
    module output). An op whose derivative is infinite at its input
    (``sqrt`` at 0, ``acos`` at 1, ``0 * inf`` in ``where``) fails under
    both.

    ``anomaly``: torch's anomaly mode stopped the user's backward at a node that returned NaN, and no check saw
    which gradient. Every floating argument is differentiated (a module without parameters has a backward too),
    and the backward runs under anomaly mode: the op is the producer only where this replay stops at a NaN as
    the user's did. A gradient of ones may make inf where the real one (0 there) made NaN: not reproduced then.
    """
    arguments = held.resolve(regenerate)
    if isinstance(arguments, Note):
        return ReplayResult(finding=None, reproduced=False,
                            note=Note.of("cannot-replay", module=module_name, reason=arguments.pair))
    args, kwargs, by_record = arguments
    held_args, held_kwargs = args, kwargs
    target_tensor = next((by_record[id(record)] for record in target if id(record) in by_record), None)
    originals = {id(tensor): tensor for _path, tensor in iter_tensors((args, kwargs))}
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        args, kwargs = copy_tensors(tuple(args), copies), copy_tensors(dict(kwargs), copies)
    for key, original in originals.items():
        every = anomaly and not target and original.is_floating_point()
        copies[key].requires_grad_(original.requires_grad or original is target_tensor or every)
    target_copy = copies.get(id(target_tensor))
    # The gradient of a tensor the call made itself (a child's output, which is no argument) is computed on
    # the way to the parameters that tensor came from: asking for theirs runs the same backward ops.
    wanted = [target_copy] if target_copy is not None else [
        *(parameter for parameter in module.parameters() if parameter.requires_grad),
        *(copy for copy in copies.values() if copy.requires_grad),
    ]
    if not wanted:
        return ReplayResult(finding=None, reproduced=False,
                            note=Note.of("computed-inside", module=module_name, overflow=False))
    failure: Exception | None = None
    with _isolated(module, module_name, rng_state, kinds, autocast=autocast) as tracer:
        # The forward runs inside the user's backward (this is a gradient
        # hook): its ops belong to that graph task, and are the replay's forward.
        tracer.forward_task = torch._C._current_graph_task_id()
        try:
            with torch.enable_grad(), tracer, held.packed():  # (saved as the call saved: a float16 pack, say)
                start = nodes_made()
                output = module(*args, **kwargs)
                # A non-finite forward value is not what is asked here; its origin is kept for a backward op (absorbed).
                tracer.reset(origins=False)
                outputs = [t for _, t in iter_tensors(output, attributes=True) if t.requires_grad]
                tracer.at_boundary = not anomaly  # (a formula may mask its first non-finite value: claim_first says)
                with torch.autograd.set_detect_anomaly(anomaly):
                    returned = torch.autograd.grad(
                        outputs, wanted, grad_outputs=[torch.ones_like(t) for t in outputs], allow_unused=True)
                tracer.claim_first(() if anomaly else returned)
        except Exception as error:
            failure = error
    if anomaly and not (isinstance(failure, RuntimeError) and ANOMALY_STOP in str(failure)):
        # No NaN returned by a node of this replay: torch's stop is not made again (from ones, not the real
        # gradient), and an op it found would be a guess.
        return ReplayResult(finding=None, reproduced=False, note=Note.of("backward-replay-finite", module=module_name))
    if tracer.finding is not None and tracer.finding.phase == Phase.BACKWARD:
        if target_copy is None and not _unscaled(tracer.finding):
            # An overflow depends on the gradient's size, and a replay from the parameters sends ones into the
            # outputs where the real gradient (scaled by a GradScaler) was larger: another op may overflow first.
            return ReplayResult(finding=None, reproduced=False,
                                note=Note.of("computed-inside", module=module_name, overflow=True))
        stop = line_stop_at(tracer, tracer.finding, start)
        if stop is None:
            return ReplayResult(finding=tracer.finding, reproduced=True)
        # The node's forward line has returned: %debug opens a replay of the forward to that line's end.
        grads = {key: copy.requires_grad for key, copy in copies.items()}
        _forward_to(stop, module, (held_args, held_kwargs), grads, module_name, rng_state, kinds, autocast)
        said = Note.of("debug-in-replay", module=module_name) if stop.frame is not None else Note.of(
            "debug-not-replayed", reason=NOT_REACHED)
        return ReplayResult(finding=tracer.finding, reproduced=True, frame=stop.frame, debug_note=said)
    if failure is not None:
        note = Note.of("backward-replay-raised", module=module_name, error=type(failure).__name__,
                       message=str(failure))
    else:
        note = Note.of("backward-replay-finite", module=module_name)
    return ReplayResult(finding=None, reproduced=False, note=note)


def _forward_to(stop: LineStop, module: nn.Module, arguments: tuple[Sequence[Any], Mapping[str, Any]],
                grads: dict[int, bool], module_name: str, rng_state: RngState | None, kinds: frozenset[str],
                autocast: AutocastState | None) -> None:
    """The forward of :func:`replay_backward` once more, as it ran (copies that require gradients where its did),
    traced to the end of ``stop``'s line (replay/line_replay.py)."""
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        args, kwargs = copy_tensors(tuple(arguments[0]), copies), copy_tensors(dict(arguments[1]), copies)
    for key, copy in copies.items():
        copy.requires_grad_(grads.get(key, False))
    with _isolated(module, module_name, rng_state, kinds, autocast=autocast) as tracer:
        tracer.forward_task = torch._C._current_graph_task_id()
        try:
            with torch.enable_grad(), tracer, stop.armed():
                module(*args, **kwargs)
        except Exception:  # raised as the first replay's forward did not (it ran on): the stop says it was not reached
            return


#: What torch's anomaly mode says as it stops a backward at a NaN ("Function 'SqrtBackward0' returned nan values in
#: its 0th output."): torch's message, not one of ours.
ANOMALY_STOP = "returned nan values in its"

#: Backward ops whose non-finite values come from their inputs' values (0/0, 1/0, a log or root at 0) and not
#: from the gradient's size: a replay with a gradient of ones makes them as the real gradient did.
_DOMAIN_OPS = frozenset({"div", "reciprocal", "pow", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "acos",
                         "asin", "atanh"})


def _unscaled(finding: OpFinding) -> bool:
    """Whether ``finding`` does not depend on the gradient's size: a NaN, or an op of :data:`_DOMAIN_OPS`."""
    return "nan" in finding.new_kinds or op_function(finding.op) in _DOMAIN_OPS


def recompute(
    module: nn.Module,
    held: HeldArguments,
    rng_state: RngState | None,
    regenerate: Regenerate,
    autocast: AutocastState | None = None,
) -> Any:
    """Run a call's forward again (no gradients, no trace) for its output; None if it cannot."""
    arguments = held.resolve(regenerate)
    if isinstance(arguments, Note):
        return None
    return run_again(module, arguments.args, arguments.kwargs, rng_state, autocast)


def enclosing_output(call: Call, calls: Iterable[Call], regenerate: Regenerate) -> Any:
    """What ``call`` returned, from a run of its enclosing call again (:func:`run_again`) whose arguments are
    held; None where they are not. For a call whose own argument was made in the enclosing call's code and
    freed (gradient checkpointing frees a block's activations; the block's input stays, for its recompute)."""
    parent = call.parent
    if (parent is None or parent.module is None or parent.held is None
            or (parent.rng_state is None and not (parent.info is not None and parent.info.deterministic))):
        return None
    arguments = parent.held.resolve(regenerate)
    siblings = [other for other in calls if other.parent is parent and other.module is call.module]
    ordinal = next((index for index, other in enumerate(siblings) if other is call), None)
    if isinstance(arguments, Note) or ordinal is None:
        return None
    seen: list[Any] = []
    handle = call.module.register_forward_hook(lambda _module, _args, output: seen.append(output))
    try:
        run_again(parent.module, arguments.args, arguments.kwargs, parent.rng_state, parent.autocast)
    finally:
        handle.remove()
    return seen[ordinal] if ordinal < len(seen) else None


def run_again(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rng_state: RngState | None,
    autocast: AutocastState | None = None,
) -> Any:
    """``module(*args, **kwargs)`` once more, on copies, leaving no trace; None if it raises.

    With ``rng_state`` the generators start from it (the same dropout mask);
    with ``autocast``, in the autocast regions the call ran in.
    """
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        args, kwargs = copy_tensors(tuple(args), copies), copy_tensors(dict(kwargs), copies)
    with _isolated(module, "", rng_state, frozenset({"nan", "inf"}), autocast=autocast) as tracer:
        tracer.forward_task = torch._C._current_graph_task_id()
        try:
            with torch.no_grad(), tracer:
                return module(*args, **kwargs)
        except Exception:
            return None


@contextlib.contextmanager
def _isolated(
    module: nn.Module,
    module_name: str,
    rng_state: RngState | None,
    kinds: frozenset[str],
    autocast: AutocastState | None = None,
    drawn: list[torch.Generator] | None = None,
) -> Iterator[OpTracer]:
    """Set up a replay of ``module`` that leaves no trace, and give its tracer.

    The generators start from ``rng_state`` and are put back afterwards;
    buffers are swapped for copies; parameters and other tensors written in
    place and the modules' Python state are put back (replay/untouched.py); the
    tracer names submodules under ``module_name``; the ``autocast`` regions
    of the original call are entered. ``drawn`` gets the user's generators the replay drew from whose state at the
    call was not kept (hot/kept/generators.py).
    """
    names = submodule_names(module, module_name)
    stack: list[str] = []
    # What the replayed module received from outside is what the watch judged it on.
    tracer = OpTracer(kinds=kinds, module_name=lambda: stack[-1] if stack else None, outside_benign=True)

    def enter(sub: nn.Module, _args: Any) -> None:
        name = names.get(id(sub))
        if name is not None:
            stack.append(name)

    def leave(sub: nn.Module, _args: Any, _output: Any) -> None:
        if id(sub) in names and stack:
            stack.pop()

    with contextlib.ExitStack() as cleanup:
        tracer.before_write = cleanup.enter_context(untouched(module)).before_write
        cleanup.enter_context(swapped_buffers(module))
        cleanup.enter_context(register_module_forward_pre_hook(enter))
        cleanup.enter_context(register_module_forward_hook(leave, always_call=True))
        for device, dtype in autocast or ():
            cleanup.enter_context(torch.autocast(device, dtype=dtype))
        draws = cleanup.enter_context(generators_at(rng_state))
        try:
            yield tracer
        finally:
            if drawn is not None:
                drawn.extend(draws.unkept)
