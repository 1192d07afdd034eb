"""Tier 1 of the step replay: keeping, for the current step, what a replay of each top-level model call needs.

:class:`StepKeeping` is the keeping half of :class:`~nan_magic.localize.replay.tiered.step.StepReplays` (which
mixes it in): each top-level call's arguments, RNG and autocast state and buffer copies at its start (begin/finish),
the gradient into its outputs, and their release once an optimizer stepped its model. It runs on every healthy
step; the replay at an event (step.py) runs only for the step that failed. Apart so that each half reads in one sitting.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections import deque
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from nan_magic.errors.frames import CODES_KEPT, is_library_code
from nan_magic.hot.kept.buffer_copies import BufferCopies, ScriptedBuffers, step_counters, with_versions
from nan_magic.hot.kept.generators import states_of
from nan_magic.hot.kept.input_writes import inputs_before
from nan_magic.hot.kept.lines import LINES, line_at
from nan_magic.hot.kept.parameter_writes import Written, written_parameters_after, written_parameters_before
from nan_magic.hot.kept.rng import ModelStates, RngState, any_autocast, capture_autocast, capture_rng_state
from nan_magic.hot.kept.saved_hooks import ENTERED as SAVED_HOOKS
from nan_magic.hot.reads import iter_tensors, version_of
from nan_magic.hot.watched.deterministic import generator_key, generators_of
from nan_magic.localize.replay.line_replay import nodes_made
from nan_magic.localize.replay.tiered.root_calls import RootCall
from nan_magic.patches.functional_calls import SWAPPED_OUT

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nan_magic.hot.kept.call_records import Call
    from nan_magic.hot.watched.targets import ModuleInfo

__all__ = ["GENERATORS_KEPT", "MAX_CALLS", "StepKeeping"]

#: Top-level calls kept at most (a GAN's two models, a siamese model called twice, a few
#: micro-batches of gradient accumulation); older ones are dropped and cannot be replayed. A call
#: is released when an optimizer has stepped every trainable parameter of its model.
MAX_CALLS = 8
#: The user's generators a model's calls keep the states of, at most (StepKeeping.learn_generators).
GENERATORS_KEPT = 8


class _Timing(Protocol):
    @property
    def deferred(self) -> bool: ...


class _Cycle(Protocol):
    trains: bool

    @property
    def timing(self) -> _Timing: ...

    def training(self) -> bool: ...

    def sync(self) -> list[float]: ...


# The code objects of the frames between the watch's pre-hook and the user's line (torch's, ours: False), and the
# user's (True), by id: the walk of each top-level call asks a dict, not a function per frame, once a code object is
# known. By id, not by the code object: a code object's hash is not cached, it hashes its bytecode, constants and
# names at each lookup (2.4 us for torch's ``Module._call_impl``, 6 us a call's walk). Each code object is held
# with its entry, so its id is not reused.
_WALKED: dict[int, tuple[CodeType, bool]] = {}
_LAST_USER: list[CodeType | None] = [None]
_NO_PARAMETERS: frozenset[int] = frozenset()
#: ``nn.Module.__call__``'s frames, passed over with no lookup: every top-level call's walk starts with them.
_CALL_IMPL = nn.Module._call_impl.__code__
_WRAPPED_CALL_IMPL = getattr(getattr(nn.Module, "_wrapped_call_impl", None), "__code__", _CALL_IMPL)
#: torch.cuda's private initialised flag, where it has one (as rng.py reads it), and the CPU generator.
_CUDA_FLAG = getattr(torch.cuda, "_initialized", None)
_CPU_GENERATOR = torch.default_generator
_GENERATOR = torch.Generator
_new_tuple = tuple.__new__


class _Watched(Protocol):
    """What keeping reads of the watch (the whole of it is step.ReplayHost)."""

    @property
    def cycle(self) -> _Cycle: ...


class StepKeeping:
    """The keeping half of :class:`~.step.StepReplays`: what each top-level call leaves."""

    # Set by the class that mixes this in.
    _buffer_copies: BufferCopies
    _generators: dict[int, list[torch.Generator]]
    _library_forward: dict[int, bool]
    _mutable: dict[int, set[int] | None]
    _slots: dict[int, tuple[list[Any], list[str], bool, frozenset[int], list[Written | None]]]
    _states: ModelStates
    _stepped: frozenset[int]
    _trainable: dict[int, frozenset[int]]
    _writes_input: set[int]
    _let_go_grads: list[torch.Tensor]
    calls: deque[RootCall]
    counts_nodes: bool
    watch: _Watched

    # -- tier 1: keeping what a replay needs --------------------------------------------

    def begin(
        self, module: nn.Module, info: ModuleInfo, call: Call, args: tuple[Any, ...], checkable: bool | None = None
    ) -> RngState:
        """A top-level call of a watched model starts (its forward pre-hook); ``call`` is the watch's record.

        Returns the generators' state taken for it (the call's own replay uses the same). ``checkable``:
        ``model(x)``'s ``is_checkable(x)``, asked by the hook already (None: another form of call).
        """
        model = id(module)
        slots = self._slots.get(model)
        if slots is None:
            found = [
                (owned if type(owned := owner._buffers) is dict else ScriptedBuffers(owned), name)
                # (keys(): a scripted module's buffers cannot be iterated by name)
                for owner in module.modules()
                for name in owner._buffers.keys()  # noqa: SIM118
            ]
            owners = [owner for owner, _name in found]
            slots = self._slots[model] = (
                owners,
                [name for _owner, name in found],
                all(type(owner) is dict for owner in owners),
                step_counters(module),
                [None, None],
            )
            self._trainable[model] = _trainable(module)
            self._library_forward[model] = is_library_code(type(module).forward.__code__)
            self._generators[model] = generators_of(module)
        training = module.training
        written = slots[4][training]
        parameters: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        learning = None
        if written is None:  # its first call in this mode: which parameters does its forward write in place?
            learning = written_parameters_before(module, training)
        elif written:  # (the usual model writes none: nothing copied, not even a tuple made)
            parameters = tuple((parameter, parameter.detach().clone()) for parameter in written)
        if slots[1]:
            mutable = self._mutable.get(model)
            owners, names, plain, counters, _written = slots
            # (Each buffer with its version, in one comprehension: with_versions inlined, every top-level call.)
            try:
                buffer_versions = (
                    [(buffer, buffer._version) for buffer in map(_dict_get, owners, names) if buffer is not None]
                    if plain
                    else [(buffer, buffer._version) for owner, name in zip(owners, names)
                          if (buffer := owner.get(name)) is not None]
                )
            except RuntimeError:  # an inference tensor has no version counter
                buffer_versions = with_versions(
                    [buffer for owner, name in zip(owners, names) if (buffer := owner.get(name)) is not None])
            if mutable is None:  # (its first call: every buffer is copied)
                live = {id(buffer): buffer for buffer, _version in buffer_versions}
            elif mutable:
                live = {key: buffer for buffer, _version in buffer_versions if (key := id(buffer)) in mutable}
            else:  # (A BatchNorm model in training changes only its step counters after the first call: no copy.)
                live = {}
            buffers = self._buffer_copies.take(module, live) if live else {}
        else:  # a model without buffers (an MLP, a transformer with LayerNorm): none to copy or follow
            buffer_versions, live, buffers, counters = [], {}, {}, _NO_PARAMETERS
        if checkable:  # (``model(x)``: no walk of the arguments; version_of inlined)
            try:
                versions = [(args[0], args[0]._version)]
            except RuntimeError:  # an inference tensor has no version counter
                versions = [(args[0], 0)]
        elif checkable is not None:
            versions = []
        else:
            versions = [(tensor, version_of(tensor)) for _path, tensor in iter_tensors(args)]
        if type(module) is nn.Sequential:  # (once for a Sequential that draws nothing: rng.py)
            rng = self._states.take(module)
        elif _CUDA_FLAG is None or torch.cuda._initialized:  # (CUDA's generators too: capture_rng_state)
            rng = capture_rng_state()
        else:  # (capture_rng_state inlined: a CPU-only program's every top-level call)
            rng = _new_tuple(RngState, (_CPU_GENERATOR.get_state(), None, ()))
        # The user's own generators it may draw from (generators.py): none for almost every model, a list's truth.
        generators = self._generators[model]
        if checkable is None and _GENERATOR in map(type, args):  # (``model(x, g)``: several arguments)
            generators = [*generators, *(arg for arg in args if type(arg) is _GENERATOR and arg not in generators)]
        if generators:
            rng = rng._replace(others=states_of(generators))
        # The user's frame that made the call (_calling_frame inlined: every top-level call). Frame 1 is the watch's
        # pre-hook; torch's _call_impl called it.
        caller: FrameType | None = sys._getframe(2)
        while caller is not None:
            if (code := caller.f_code) is _CALL_IMPL or code is _WRAPPED_CALL_IMPL:  # (torch's __call__: no lookup)
                caller = caller.f_back
                continue
            if code is _LAST_USER[0]:  # (the loop's line of the last call: the usual step's, no lookup)
                break
            walked = _WALKED.get(id(code))
            if walked is None:
                if len(_WALKED) >= CODES_KEPT:  # (code compiled again each step: exec'd, eval'd)
                    _WALKED.clear()
                walked = _WALKED[id(code)] = (code, not is_library_code(code))
            if walked[1]:
                _LAST_USER[0] = code
                break
            caller = caller.f_back
        # (f_lineno scans the code's line table: kept by instruction, lines.py; line_at's lookup inlined, every step)
        line = 0
        if caller is not None:
            code = caller.f_code
            try:
                line = LINES[code.co_linetable, code.co_firstlineno, caller.f_lasti] if caller.f_trace is None else (
                    caller.f_lineno)
            except KeyError:
                line = line_at(caller)
        calls = self.calls
        if len(calls) == MAX_CALLS and (cycle := self.watch.cycle).timing.deferred:
            # The oldest call is let go now; judged after, no replay could call its -inf deliberate (a rollout's
            # masked logits) or name a NaN's op. So the step is judged now: a host read per MAX_CALLS calls more.
            cycle.sync()
        calls.append(
            RootCall(
                module=module,
                info=info,
                args=args,
                rng=rng,
                grad_enabled=torch.is_grad_enabled(),
                autocast=capture_autocast() if any_autocast() else None,  # (the usual step's None, with no call more)
                buffers=buffers,
                buffer_sources=list(live.values()),
                versions=versions,
                buffer_versions=buffer_versions,
                counters=counters,
                call=call,
                site=(caller.f_code, line, caller.f_globals)
                if caller is not None and self._library_forward[model]
                else None,
                caller=(caller.f_code, id(caller), caller.f_lasti, line) if caller is not None else None,
                nodes_before=nodes_made() if self.counts_nodes else None,
                parameters=parameters,
                learning=learning,
                # (a model seen writing its input in place keeps a copy of it: input_writes.py; a set's test, no call)
                inputs_before=inputs_before(versions) if model in self._writes_input else (),
                # (the saved-tensor hooks in effect: a list's truth, no call; the usual loop's None)
                saved_hooks=SAVED_HOOKS[-1] if SAVED_HOOKS else None,
                # (a list's truth, no call: MAML's loops alone have a swap in progress)
                in_functional_call=any(swapped is module for swapped, _own in SWAPPED_OUT) if SWAPPED_OUT else False,
                training=training,
            )
        )
        return rng

    def input_written(self, tensor: torch.Tensor, limit: int) -> None:
        """The loop's code is about to write ``tensor`` in place after a kept call of the step read it (``x.add_()``
        building a second view, the next batch prefetched into the static buffer before ``backward()``): that call
        keeps a copy of it first, the value it read, for its replay at the deferred check (``inputs_before``). Asked
        only by loss code that writes in place (outside/region_records.py), and only where the check is deferred.
        A view written (``x[:, :3] = 1``) is the input's: the whole input is copied, where within ``limit`` bytes.
        Another part of the same buffer (``obs_buf[t + 1].copy_(obs)`` after ``policy(obs_buf[t])``, a rollout's
        storage) is not: only a write whose memory meets the input's copies it."""
        for root in self.calls:
            for held, version in root.versions:
                if _meet(held, tensor) and version_of(held) == version and held.nbytes <= limit and not any(
                        kept is held for kept, _copy in root.inputs_before):
                    root.inputs_before = (*root.inputs_before, (held, held.detach().clone()))

    def inputs_before_of(self, call: Call) -> dict[int, torch.Tensor]:
        """What a held top-level call of a model seen writing its input in place kept of its inputs, by the input's
        id: their values before the call (input_writes.py), for a per-module watch's replay of it."""
        root = next((root for root in reversed(self.calls) if root.call is call), None)
        return {id(tensor): before for tensor, before in root.inputs_before} if root is not None else {}

    def arguments_of(self, call: Call) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A held top-level call's arguments as it was made (the scene saves its plain ones); None if not held."""
        root = next((root for root in self.calls if root.call is call), None)
        return (root.args, root.kwargs) if root is not None else None

    def finish(self, module: nn.Module, kwargs: dict[str, Any], output: Any = None) -> None:
        """The top-level call returned (or raised): note its keyword arguments, and what its buffers did."""
        calls = self.calls  # (the latest call first, inlined: the usual step's one call is it)
        root = calls[-1] if calls and calls[-1].module is module else self._latest(module)
        if root is None or root.returned:
            return
        root.returned = True
        root.kwargs = dict(kwargs)
        if root.grad_enabled and not ((cycle := self.watch.cycle).trains or cycle.training()):
            # Only an inference step drops its calls when the next step begins (new_step): training keeps them anyway.
            root.outputs = [
                weakref.ref(tensor)
                for _path, tensor in iter_tensors(output, attributes=True)
                if tensor.grad_fn is not None
            ]
        for tensor, version in root.versions:  # (read as the call began: did its forward write its input in place?)
            try:  # (``_version`` read directly, a loop, not a call: this runs at every top-level call)
                wrote = tensor._version != version
            except RuntimeError:  # an inference tensor has no version counter
                wrote = False
            if wrote:  # (its next calls keep a copy of their input: input_writes.py)
                self._writes_input.add(id(module))
                break
        if kwargs:
            root.versions += [(tensor, version_of(tensor)) for _path, tensor in iter_tensors(kwargs)]
            if drawn := [value for value in kwargs.values() if type(value) is _GENERATOR]:
                # ``model(x, generator=g)``: a pre-hook sees no keyword argument, so its state is kept from the next
                # call on (generators.py).
                self.learn_generators(module, drawn)
        if root.learning is not None:
            training, written = written_parameters_after(root.learning)
            self._slots[id(module)][4][training] = written
        model = id(module)  # (asked once: every top-level call)
        if not root.buffer_versions:  # (a model without buffers: nothing moved, nothing to learn)
            if model not in self._mutable:
                self._mutable[model] = set()
            return
        # (A BatchNorm's step counter is counted back at a replay, not copied: counted_back. ``_version`` read
        # directly, in a loop, not a comprehension's call: this runs at every top-level call.)
        counters = root.counters
        moved: set[int] = set()
        try:
            for buffer, version in root.buffer_versions:
                if buffer._version != version and (key := id(buffer)) not in counters:
                    moved.add(key)
        except RuntimeError:  # an inference tensor has no version counter
            moved = {key for buffer, version in root.buffer_versions
                     if version_of(buffer) != version and (key := id(buffer)) not in counters}
        known = self._mutable.get(model)
        if known is None or moved - known:  # (the usual call moves nothing new: the set stays as it is)
            self._mutable[model] = moved | known if known else moved

    def capture_gradient(self, call: Call, path: str, grad: torch.Tensor) -> None:
        """The gradient flowing into output ``path`` of a top-level call (its tensor hook)."""
        for root in self.calls:
            if root.call is call:
                grads = root.output_grads
                if path in grads and self.watch.cycle.timing.deferred:
                    # A second backward into this output before the step (``l1.backward(retain_graph=True);
                    # l2.backward()``): a replay of the backward takes the latest; the earlier one, which only its
                    # record holds (weakly: backward/gradient_checks.py), is kept alive for the step's check to count.
                    root.earlier_grads.append(grads[path])
                grads[path] = grad
                return
        if self.watch.cycle.timing.deferred:
            # A call let go of (over MAX_CALLS a step): its gradient, which only its record holds (weakly), would be
            # freed before the check, never counted. Held for it; as the forward does where it lets a call go, the
            # step is judged now once MAX_CALLS are held: a host read per MAX_CALLS gradients more, only there.
            held = self._let_go_grads
            if len(held) == MAX_CALLS:
                self.watch.cycle.sync()
                held.clear()
            held.append(grad)

    def clear(self) -> None:
        """The watch ends: nothing can need a replay any more."""
        self.calls.clear()
        self._let_go_grads.clear()
        self._stepped = _NO_PARAMETERS
        self._buffer_copies.clear()

    def new_step(self, training: bool) -> None:
        """A step begins: inference steps drop the last step's calls; training keeps the calls not yet stepped.

        A call still waiting from an earlier step is one whose model's trainable parameters (learned at its first
        call) no optimizer stepped: they may have changed since (a layer unfrozen, an embedding resized), so they are
        learned again.
        """
        if self._stepped:
            self._stepped = _NO_PARAMETERS
        if not self.calls:  # (a training step released its calls as its optimizer stepped: nothing to learn)
            return
        if not training:
            # Inference: the last step's calls are dropped as the next step begins, each unless a backward
            # may still reach it (a GAN's generator called before the discriminator, while no optimizer
            # has stepped yet; a siamese model's first call): then it stays while an output with a graph lives.
            waiting = [root for root in self.calls if root.awaits_backward()]
            self._keep(waiting)
        for module in {id(root.module): root.module for root in self.calls}.values():
            self._trainable[id(module)] = _trainable(module)

    def release_stepped(self, opt: torch.optim.Optimizer, ids: frozenset[int] | None = None) -> None:
        """``opt`` stepped: drop the calls of models with nothing left to step this step.

        A call is kept while its model has a trainable parameter that no optimizer stepped since the step began: a
        GAN's generator call, made before the discriminator's step, waits for its own optimizer (its backward may
        still fail). A model without trainable parameters (a frozen teacher) is dropped at the first step. The
        trainable parameters are those of the model's first call in the watch (a set per model, not a walk of its
        parameters each step), learned again for a call still waiting when the next step begins (new_step).
        ``ids``: the ids of ``opt``'s parameters, as its pre-hook's layout holds them (a set made once a
        layout, hot/checks/optimizer/layouts.py: none is built here each step); None: read from its groups.
        """
        if ids is None:
            groups = opt.param_groups
            ids = frozenset(
                map(
                    id,
                    groups[0]["params"]
                    if len(groups) == 1
                    else itertools.chain.from_iterable(group["params"] for group in groups),
                )
            )
        self._stepped = stepped = ids if not self._stepped else self._stepped | ids
        if self._let_go_grads:  # (the step's check has counted them: it ran at the optimizer's pre-hook)
            self._let_go_grads.clear()
        calls = self.calls
        if len(calls) == 1:  # (the usual step, one model call: no list of the waiting ones, no _keep)
            root = calls[0]
            if self._trainable.get(id(root.module), _NO_PARAMETERS) <= stepped:
                if root.buffers and self._mutable.get(id(root.module)):  # (copies a next call will copy into)
                    self._buffer_copies.recycle(((root.module, root.buffer_sources, root.buffers),))
                self.calls = deque(maxlen=MAX_CALLS)
            return
        waiting = [root for root in calls if not self._trainable.get(id(root.module), _NO_PARAMETERS) <= stepped]
        self._keep(waiting)

    def _keep(self, waiting: list[RootCall]) -> None:
        """Keep only the ``waiting`` calls; the buffer copies of the others are free for the next calls."""
        if len(waiting) != len(self.calls):
            # (Every call released, the usual training step: no test of each against the waiting ones.)
            released = (
                self.calls
                if not waiting
                else [root for root in self.calls if not any(root is kept for kept in waiting)]
            )
            for root in released:
                # (Copies a next call will copy into: none where its calls change no buffer it copies, a BatchNorm
                # model's after its first call, whose copies of every buffer are then let go, not kept for the watch.)
                if root.buffers and self._mutable.get(id(root.module)):
                    self._buffer_copies.recycle(((root.module, root.buffer_sources, root.buffers),))
            self.calls = deque(waiting, maxlen=MAX_CALLS)

    def learn_generators(self, module: nn.Module, drawn: list[torch.Generator]) -> None:
        """A replay of ``module``'s call drew from generators whose state the call did not keep (a global's, a
        closure's, a keyword argument's): its next calls keep them (generators.py). At most
        :data:`GENERATORS_KEPT` learned ones, the latest (those its modules hold all stay): a loop that passes a new
        generator each call (``generator=torch.Generator().manual_seed(step)``) holds no more of them alive, nor
        takes more states a call."""
        known = self._generators.setdefault(id(module), [])
        keys = {generator_key(generator) for generator in known}
        known.extend(generator for generator in drawn if generator_key(generator) not in keys)
        # Those its modules hold (found at its first call) always stay; only the learned ones are capped.
        held = {generator_key(generator) for generator in generators_of(module)}
        learned = [generator for generator in known if generator_key(generator) not in held]
        if len(learned) > GENERATORS_KEPT:
            dropped = {generator_key(generator) for generator in learned[:len(learned) - GENERATORS_KEPT]}
            known[:] = [generator for generator in known if generator_key(generator) not in dropped]

    def _latest(self, module: nn.Module) -> RootCall | None:
        return next((root for root in reversed(self.calls) if root.module is module), None)

    # -- tier 2: the replay ---------------------------------------------------------------


_dict_get: Any = dict.get


def _trainable(module: nn.Module) -> frozenset[int]:
    """The ids of ``module``'s parameters that require gradients (release_stepped waits for them).

    Each module's own ``_parameters``, not ``module.parameters()``: that walk hashes every parameter in
    Python (``Tensor.__hash__``) to drop repeats, which the set of ids does; every step of gradient
    accumulation, which no optimizer steps, learns them again (new_step).
    """
    return frozenset(
        id(parameter)
        for child in module.modules()
        for parameter in child._parameters.values()
        if parameter is not None and parameter.requires_grad
    )


def _meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' spans of memory meet (the same storage, overlapping byte ranges: a strided view's gaps
    count as its own, so this may say yes for interleaved views that share no element, never no for ones that do)."""
    if a is b:
        return True
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a_start, a_end), (b_start, b_end) = _span(a), _span(b)
    return a_start < b_end and b_start < a_end


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    if not tensor.numel():
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (last + 1) * tensor.element_size()
