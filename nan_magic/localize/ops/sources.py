"""Where in the user's code an op ran: its line, the frame for ``%debug``, and whose code called it.

The op tracer (:mod:`nan_magic.localize.ops.tracer`) runs inside the op, below torch's
dispatch machinery and its own frames; the line a finding names is the
innermost frame that is the user's (:func:`user_frame`). A backward op runs in
the autograd engine, with no user frame on the stack: its forward line is the
one that created the autograd node being executed, noted while the forward
ran (:class:`NodeSources`). And an op that nan_magic's own code called (a
hook's reduction, a gradient norm) is never judged (:func:`called_by_us`).
"""

from __future__ import annotations

import linecache
import os
import sys
from collections.abc import Callable, Sequence
from types import CodeType, FrameType
from typing import Any

import torch
import torch.utils.checkpoint

from nan_magic.errors.frames import CODES_KEPT, frames_running, is_library_code, pointer, pointer_at
from nan_magic.errors.line_state import one_call
from nan_magic.localize.ops.owners import CALL_IMPL, forward_hook_module
from nan_magic.localize.ops.plans import Plan, tensors
from nan_magic.records import SourcePointer

__all__ = ["GENERATED", "PASSED_OVER", "NodeSources", "ReplayedFrom", "called_by_the_engine", "called_by_us",
           "defined_below", "hook_definer", "is_plumbing", "passed_over", "recomputing", "sources_of_op", "user_frame"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OPS_DIR = os.path.dirname(os.path.abspath(__file__))
# nan_magic/, two folders above this one (localize/ops/).
_OWN_DIR = os.path.dirname(os.path.dirname(_OPS_DIR)) + os.sep
# nan_magic's own files, and torch's machinery between a Python call and a
# dispatch mode: a frame there is never the line that ran an op.
_PLUMBING = (
    _OWN_DIR,
    *(
        _TORCH_DIR + path
        for path in ("_ops.py", "utils/_python_dispatch.py", "_tensor.py", "overrides.py",
                     "autograd/__init__.py", "autograd/graph.py", "_dynamo", "_compile.py")
    ),
)


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame at or above ``frame`` that is the user's code (not torch's, not ours)."""
    while frame is not None and passed_over(frame.f_code):
        frame = frame.f_back
    return frame


_SUBCLASS_HOOKS = frozenset({"__torch_function__", "__torch_dispatch__"})

#: id(code) -> (code, whether :func:`user_frame` passes over it); holding the code keeps its id unique.
#: Read inline by the loss-code recorder, which walks up from every op it records.
PASSED_OVER: dict[int, tuple[CodeType, bool]] = {}


#: The ids of the passed-over codes that torch.fx generated (a ``torch.compile``d function's graph, run by an eager
#: backend): the user's line of an op it runs is its graph node's (outside/generated.py). Held in PASSED_OVER.
GENERATED: set[int] = set()


def passed_over(code: CodeType) -> bool:
    """Whether a frame running ``code`` is never the user's line: library code, or a tensor subclass's
    ``__torch_function__`` (how the op was routed, not the line that asked for it: the caller's is)."""
    entry = PASSED_OVER.get(id(code))
    if entry is None:
        if len(PASSED_OVER) >= CODES_KEPT:  # (code compiled again at each step: exec'd, eval'd; GENERATED's ids too)
            PASSED_OVER.clear()
            GENERATED.clear()
        entry = PASSED_OVER[id(code)] = (code, is_library_code(code) or code.co_name in _SUBCLASS_HOOKS)
        if code.co_filename.startswith("<eval_with_key>"):
            GENERATED.add(id(code))
    return entry[1]


def is_plumbing(frame: FrameType) -> bool:
    """Whether ``frame`` is torch's or our machinery between a Python call and a dispatch mode (never a line
    that asked for an op, nor a library function that ran one)."""
    filename = frame.f_code.co_filename
    return os.path.abspath(filename).startswith(_PLUMBING) or filename.endswith(
        ("contextlib.py", "functools.py")
    )


# The op tracer's own files: its frames stand between an op and whoever called it.
_TRACER_FILES = frozenset(
    os.path.join(_OPS_DIR, name)
    for name in ("tracer.py", "origin_rules.py", "plans.py", "sources.py", "origins.py", "kinds.py", "witnesses.py",
                 "reached.py")
)
# Our files that call the user's code: the wrapped Tensor.backward, a replay running a module
# (whose ops are the module's, even an nn.Linear's), a replayed step and its backward, and the
# recorded ops of the code outside the models, run again, and a replayed optimizer step.
_RUNS_USER_CODE = tuple(
    os.path.join(_OWN_DIR, name)
    for name in (
        os.path.join("patches", "backward.py"),
        os.path.join("localize", "replay", "module_run.py"),
        os.path.join("localize", "replay", "tiered", "step.py"),
        os.path.join("localize", "replay", "tiered", "step_keeping.py"),
        os.path.join("localize", "replay", "tiered", "root_calls.py"),
        os.path.join("localize", "replay", "tiered", "step_backward.py"),
        os.path.join("localize", "outside", "recorder.py"),
        os.path.join("localize", "outside", "region_records.py"),
        os.path.join("localize", "outside", "recorded_ops.py"),
        os.path.join("localize", "replay", "optimizer.py"),
    )
)


def called_by_us() -> bool:
    """Whether the current op was called by nan_magic's own code (a hook's reduction, a norm).

    The innermost frame outside torch and the tracer decides; the autograd
    engine runs the user's backward with no such frame, or below our wrapped
    ``Tensor.backward``.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename in _TRACER_FILES or filename.startswith(_TORCH_DIR) or filename.endswith(
            ("contextlib.py", "functools.py")
        ):
            frame = frame.f_back
            continue
        return filename.startswith(_OWN_DIR) and filename not in _RUNS_USER_CODE
    return False


#: ``(code, id(frame), f_lasti, f_lineno)`` of the user's frame as it called a watched model (no reference to the
#: frame, which a helper that called the model lets go of as it returns).
Caller = tuple[CodeType, int, int, int]
#: Frames the traceback lacks, outermost first, each ``(frame, f_lasti, f_lineno)`` as it called the next.
Chain = tuple[tuple[FrameType, int, int], ...]
#: ``(the frame running a replay, the user's line that made the replayed call, where its frame stood then)``,
#: innermost last.
_REPLAYED_FROM: list[tuple[FrameType, tuple[CodeType, int, dict[str, Any]] | None, Caller | None]] = []


class ReplayedFrom:
    """While a replay of a recorded model call runs from ``frame``: its ops' line is the call's ``site``.

    Inside a model whose code is all torch's (an ``nn.Sequential`` of ``nn.Linear``, a
    parametrization), the innermost user frame of an op is the line that called the
    model; a replay calls it again from wherever the event was judged (``opt.step()`` for
    the deferred check, ``loss.backward()`` for a gradient), which is not that line.
    """

    def __init__(self, site: tuple[CodeType, int, dict[str, Any]] | None, frame: FrameType,
                 caller: Caller | None = None) -> None:
        self._entry = (frame, site, caller)

    def __enter__(self) -> None:
        _REPLAYED_FROM.append(self._entry)

    def __exit__(self, *exc: object) -> None:
        _REPLAYED_FROM.remove(self._entry)


def _replayed_site(frame: FrameType | None, user: FrameType | None) -> tuple[CodeType, int, dict[str, Any]] | None:
    """The recorded call's line, where the walk from ``frame`` up to ``user`` passed a replay's frame."""
    if not _REPLAYED_FROM:
        return None
    replays = {id(replay): site for replay, site, _caller in _REPLAYED_FROM}
    while frame is not None and frame is not user:
        site = replays.get(id(frame))
        if site is not None:
            return site
        frame = frame.f_back
    return None


def replayed_calls(frame: FrameType) -> tuple[Caller | None, Chain] | None:
    """How a replay reached ``frame`` (the user's frame that ran an op): the replayed call's caller, and the
    user's frames of the replay between that call and ``frame`` (``Net.forward`` calling ``self.block(x)``).

    None where ``frame`` is not below a replay (a live trace: the traceback holds its callers). The report's
    frames and ``%debug``'s ``up`` then read from the loop's line that called the model, through each forward
    that called the next, to the producing line (errors/frames.end_at_producer).
    """
    if not _REPLAYED_FROM:
        return None
    replays = {id(replay): caller for replay, _site, caller in _REPLAYED_FROM}
    chain: list[tuple[FrameType, int, int]] = []
    current = frame.f_back
    while current is not None:
        if id(current) in replays:
            return replays[id(current)], tuple(reversed(chain))
        if not passed_over(current.f_code):
            chain.append((current, current.f_lasti, current.f_lineno))
        current = current.f_back
    return None


def live_calls(frame: FrameType) -> Chain:
    """A live trace's user frames above ``frame`` (the user's frame that ran the op), outermost first, each as it
    called the next. Where they return before the check raises (a helper the forward called, the forward itself:
    ``mode="full"`` or ``ops=True`` judges a forward's value at the model's output), the traceback lacks them; the
    report's frames and ``%debug``'s ``up`` read through them as in the default watch (frames.end_at_producer).

    Below a replay of a module call that the watch made while the user's frames above it ran (``mode="full"``
    judging a child's input inside the forward, then replaying the forward to name the op), the replay's frames
    re-run calls that are still running: each is the running frame (line_state.one_call: the same function, alike
    arguments), at the line where the replay's called the next, so that a call stands once, and a recursion's
    depths stay apart."""
    replayed: list[tuple[FrameType, int, int]] = []
    running: list[tuple[FrameType, int, int]] = []
    above_ours = False  # (past the watch's own first frame: the user's frames there were running)
    current = frame.f_back
    while current is not None:
        above_ours = above_ours or current.f_code.co_filename.startswith(_OWN_DIR)
        if not passed_over(current.f_code):
            (running if above_ours else replayed).append((current, current.f_lasti, current.f_lineno))
        current = current.f_back
    if not running:
        return tuple(reversed(replayed))
    outer, inner = list(reversed(running)), list(reversed(replayed))
    start = next((index for index in range(len(outer) - 1, -1, -1) if inner and _one_call(outer[index], inner[0])),
                 None)
    if start is None:
        return (*outer, *inner)  # (the replayed call had returned: judged at the model's output)
    chain, index = outer[:start], 0
    while start + index < len(outer) and index < len(inner) and _one_call(outer[start + index], inner[index]):
        chain.append((outer[start + index][0], inner[index][1], inner[index][2]))
        index += 1
    return (*chain, *inner[index:])


def _one_call(running: tuple[FrameType, int, int], replayed: tuple[FrameType, int, int]) -> bool:
    return running[0].f_code is replayed[0].f_code and one_call(running[0], replayed[0])


def calls_from_caller(replayed: tuple[Caller | None, Chain] | None) -> Chain:
    """``replayed`` (:func:`replayed_calls`) as the calls from the user's frame that called the model, where that
    frame is still running (found on the current stack by its code and id); empty where it is not (a helper that
    called the model has returned: the traceback then reads from where the step was judged, as before)."""
    if replayed is None:
        return ()
    caller, chain = replayed
    if caller is None:
        return ()
    code, key, lasti, lineno = caller
    for frame in frames_running(sys._getframe(1)):  # (or unwound by an exception leaving the watch, held by it)
        if id(frame) == key and frame.f_code is code:
            return ((frame, lasti, lineno), *chain)
    return ()


def sources_of_op(
    frame: FrameType | None,
) -> tuple[SourcePointer | None, SourcePointer | None, FrameType | None]:
    """The user's line that ran the current op, the innermost line below it, and the user's frame."""
    while frame is not None and is_plumbing(frame):
        frame = frame.f_back
    user = user_frame(frame)
    if frame is None:
        return None, None, None
    site = _replayed_site(frame, user)
    if site is not None:
        return pointer_at(*site), pointer(frame), user
    if user is None:
        return None, pointer(frame), None
    return pointer(user), (pointer(frame) if frame is not user else None), user


# Where Python enters the autograd engine (``loss.backward()``, ``torch.autograd.grad``).
_ENGINE_ENTRIES = tuple(_TORCH_DIR + os.path.join("autograd", name) for name in ("graph.py", "__init__.py"))


def hook_definer(module: str | None, user: FrameType | None,
                 enclosing: Callable[[str, str], str | None] | None) -> str | None:
    """The module whose forward defined the Python backward code ``user`` runs (a gradient hook), else ``module``.

    ``module`` is the forward module of the autograd node the code ran in: for a hook that a module's forward
    registered on its child's output (``h = self.fc(x); h.register_hook(lambda g: g * s)``), the child, while the
    hook is the parent's code. A hook or backward defined inside a class's method (Python's qualified name of its
    code, ``Parent.forward.<locals>.<lambda>``) is named as the nearest module of that class at or above
    ``module`` (``enclosing``: by the modules' places in their model, op_origins.py); one defined elsewhere (a
    module-level function, a custom Function's ``backward``) keeps ``module``.
    """
    if user is None or module is None or enclosing is None:
        return module
    definer, _sep, inner = user.f_code.co_qualname.partition(".<locals>")
    owner = definer.rpartition(".")[0]  # (Python's qualified name of a code object, not a module's name)
    return (enclosing(module, owner) or module) if inner and owner else module


def defined_below(module: str | None, code: CodeType | None, within: Callable[[str, str], str | None] | None,
                  owned: str | None = None) -> str | None:
    """The module of a backward op's node whose forward line ``code`` is a method of a child's class, else ``module``.

    ``module`` is the module running when the node was made (the watch's stack): for ``self.act.forward(h)``, a call
    with no hook, the parent. Where the line's code is a method of another class (Python's qualified name of a
    code, ``SqrtAbs.forward``) and exactly one watched module of that class lies below ``module`` (``within``: by
    the modules' places in their model, op_origins.py), its own code made the node (PRODUCT.md). A class of which
    several lie below, or none, keeps ``module``; ``owned``, the watched module below ``module`` that was the code's
    ``self`` (NodeSources.owner_of), says which of several it was. Called at an event only.
    """
    if owned is not None:
        return owned
    if module is None or code is None or within is None:
        return module
    owner, _sep, method = code.co_qualname.rpartition(".")
    if not owner or "<locals>" in owner or not method:
        return module
    return within(module, owner) or module


def called_by_the_engine(frame: FrameType | None, user: FrameType) -> bool:
    """Whether ``user``, the user's frame that ran a backward op, was called by the autograd engine.

    ``frame`` is the op's (innermost) frame. A built-in gradient formula
    (``SqrtBackward0``) runs with no Python frame of its own: the innermost
    user frame is the line that called ``backward()``, and the engine's entry
    lies between the op and it. A Python backward (a custom
    ``autograd.Function``'s ``backward``, a gradient hook) is called by the
    engine: no entry lies between, and its line is where the op ran. On a
    device thread of the engine no entry is on the stack at all.
    """
    while frame is not None and frame is not user:
        if os.path.abspath(frame.f_code.co_filename).startswith(_ENGINE_ENTRIES):
            return False
        frame = frame.f_back
    return True


#: How many autograd nodes' forward lines a trace keeps (the most recent).
MAX_SOURCES = 200_000


class NodeSources:
    """The user's forward line of each autograd node created while the tracer is active.

    Autograd numbers the nodes it creates from a thread-local counter
    (``Node._sequence_nr()``), and an op's node is created just before the op
    is dispatched to the tracer. So when ``torch._C._autograd._get_sequence_nr()``
    has moved since the previous op, node ``counter - 1`` belongs to the
    current op, and :meth:`note` records its user line (a code object and a
    line number, no frames kept). In backward,
    ``torch._C._current_autograd_node()._sequence_nr()`` looks that line up
    (:meth:`forward_source`). This costs a counter read per op and a short
    stack walk per node created, unlike anomaly mode, which formats a full
    traceback per node. The most recent :data:`MAX_SOURCES` nodes are remembered, each with what
    ``module_name()`` (the qualified name of the module running, or None) said as it was noted.
    """

    def __init__(self, module_name: Callable[[], str | None]) -> None:
        self._module_name = module_name
        #: A watched module's name by its id (op_origins.py sets it, with the tracer's): a root's own forward hook.
        self.named: Callable[[int], str | None] | None = None
        # autograd sequence number -> (code, line) of the forward op that created it, its module, the id of the
        # module whose method that code is (its ``self``), and the op (names an operand its node saved as the
        # forward op's argument: ``weight`` of nll_loss_forward)
        self._sources: dict[int, tuple[CodeType, int, str | None, int | None]] = {}
        self._ops: dict[int, Any] = {}
        self._seen_seq = 0
        self._last_location: tuple[CodeType, int, str | None, int | None] | None = None

    def start(self) -> None:
        """Begin a trace: nodes created before it are not ours to name."""
        self._seen_seq = torch._C._autograd._get_sequence_nr()
        self._last_location = None

    def record(self, node: int, code: CodeType, lineno: int, module: str | None = None) -> None:
        """Name node number ``node``'s forward line directly (a replay of recorded ops gives the recorded line), and
        its module where the recorded code is one's (a root's own forward hook: outside/region_records.py)."""
        self._sources[node] = (code, lineno, module, None)
        self._ops.pop(node, None)  # (its op is not known here)
        # Not named again by the next op's note (a custom Function's node is made after its forward's last op).
        self._seen_seq = max(self._seen_seq, node + 1)

    def note(self, plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], func: Any = None) -> None:
        """Called by the tracer for each forward op, before it runs: note the lines of the nodes made since."""
        seq = torch._C._autograd._get_sequence_nr()
        if seq == self._seen_seq:
            return
        # A node or two at most comes between two ops; a long gap is nodes
        # made outside this thread's forward (a backward with create_graph).
        first = max(self._seen_seq, seq - 8)
        self._seen_seq = seq
        # Frame 1 is the tracer's __torch_dispatch__; the op's caller is above it.
        caller = sys._getframe(2)
        frame = user_frame(caller)
        site = _replayed_site(caller, frame)
        if site is not None:
            location: tuple[CodeType, int, str | None, int | None] | None = (
                site[0], site[1], self._module_name(), None)
        elif frame is not None:
            # A method's ``self`` (a frame's locals, read per node made): which module's code made the node, where
            # its parent called it without a module call (``self.act.forward(h)``: defined_below).
            code = frame.f_code
            own = frame.f_locals.get("self") if code.co_argcount and code.co_varnames[0] == "self" else None
            module = self._module_name()
            if code.co_name != "forward" and frame.f_back is not None and (
                    frame.f_back.f_code.co_filename == CALL_IMPL.co_filename):
                # A forward hook of the user's, run after the watch took its module off the stack: the stack says
                # the parent, and the hooked module made the node (as hook_owner names its forward ops).
                hooked = forward_hook_module(frame, module, self.named)
                module = module if hooked is None else hooked
            location = (code, frame.f_lineno, module, id(own) if isinstance(own, torch.nn.Module) else None)
        else:
            location = None
        sources = self._sources
        own = torch.is_grad_enabled() and any(
            t.requires_grad for _, t in tensors(plan, args, kwargs, plan.reads)
        )
        if own:
            # This op's node is the newest; older new nodes were made after the
            # previous op was dispatched, by its autograd wrapper (CopySlices
            # of an in-place op on a view).
            if location is not None:
                sources[seq - 1] = location
                self._ops[seq - 1] = func
            if self._last_location is not None:
                for key in range(first, seq - 1):
                    sources[key] = self._last_location
        elif location is not None:
            # Nodes made since the previous op and none by this one: a custom
            # autograd.Function, whose forward this op runs in.
            for key in range(first, seq):
                sources[key] = location
        self._last_location = location
        if len(sources) > MAX_SOURCES:
            # Keys were inserted in increasing order: drop the oldest half.
            for key in list(sources)[: len(sources) // 2]:
                del sources[key]
                self._ops.pop(key, None)

    def forward_source(self, node: Any) -> tuple[SourcePointer | None, str | None]:
        """The forward line that created ``node``, and the module it ran in."""
        entry = self._sources.get(node._sequence_nr()) if node is not None else None
        if entry is None:
            return None, None
        code, lineno, module, _owner = entry
        line = linecache.getline(code.co_filename, lineno).strip() or None
        return SourcePointer(code.co_filename, lineno, code.co_name, line), module

    def code_of(self, number: int) -> CodeType | None:
        """The code whose line made node number ``number`` (its ``_sequence_nr()``), where this trace named it."""
        entry = self._sources.get(number)
        return entry[0] if entry is not None else None

    def owner_of(self, number: int) -> int | None:
        """The id of the module whose method made node number ``number``, where this trace named it."""
        entry = self._sources.get(number)
        return entry[3] if entry is not None else None

    def forward_op(self, node: Any) -> tuple[str | None, SourcePointer | None]:
        """The forward op that created ``node`` (``aten.nll_loss_forward.default``) and its line, where traced."""
        func = self._ops.get(node._sequence_nr())
        return (str(func) if func is not None else None), self.forward_source(node)[0]


_REENTRANT_BACKWARD = torch.utils.checkpoint.CheckpointFunction.backward.__code__


def recomputing() -> bool:
    """Whether an op in backward, with grad enabled, belongs to an activation checkpoint's recompute of its forward.

    The non-reentrant form recomputes under its own saved-tensor hooks; the reentrant one inside
    ``CheckpointFunction.backward``. (Asked only of an op that runs in backward with grad enabled: a
    recompute, or a ``create_graph`` backward.)
    """
    if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        return True
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _REENTRANT_BACKWARD:
            return True
        frame = frame.f_back
    return False
