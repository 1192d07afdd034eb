"""The watch's optimizer step hooks, kept out of what ``torch.compile`` traces.

``@torch.compile def step(): opt.step()`` is a documented recipe, and dynamo traces
``Optimizer.step``'s wrapper (torch/optim/optimizer.py ``profile_hook_step``), the global step hooks it calls
included: it would inline the watch's hooks, break its graph on what they do (``.item()``, generators, the
profiler), compile each frame they call as a frame of its own (``hot/reads.py``'s ``is_checkable`` to its
recompile limit, with a warning naming it) and keep a guard's weak reference on every parameter they read
(which ``torch.utils.swap_tensors`` refuses). A hook wrapped by ``torch._dynamo.disable`` is called, not traced:
dynamo runs the wrapper's hook loop eagerly and compiles the optimizer's own step as before, and nothing runs
under dynamo inside the hook. torch's wrapper costs ten Python calls a hook, ours (:func:`_opaque`, the same
effect) three; still, the hooks are registered bare and swapped for their wrapped selves (same place in the hook
dicts) as dynamo starts its first compile while they are registered: a loop that compiles nothing pays nothing.

An optimizer whose step runs hooks of the user's (``opt.register_step_pre_hook``, ``register_step_post_hook``, or
global ones: a gradient normalisation before the update, a max-norm projection of the weights after it) has the
watch's hooks *seated* on it as well (:class:`_Seats`): its step's checks run from a pre-hook of its own after
every pre-hook of the user's, and from a post-hook of its own before every post-hook of the user's. The user's
pre-hooks are then loop code before the step (the update code, recorded, its gradient writes judged by the step's
gradient check), and the user's post-hooks loop code after it (the data code, recorded), as the same lines written
in the loop around ``opt.step()`` are; not code inside a step, which a bounded step's argument (step_layout.py) says
nothing of. The global pre-hook passes such a step by; the global post-hook, kept after the user's global ones,
judges the parameters the user's post-hooks wrote as written by that step. Only the watch's own entries are moved
(to the end, to the front), to stay so as the user adds hooks; the user's keep their order.

Only where ``torch._dynamo`` is loaded as the watch attaches (``torch.compile`` loads it: a step compiled before
the watch, or in an earlier cell under the held watch, which attaches at each cell): importing it takes seconds
(4.9 s on a busy 2-core machine), which a watch of an eager loop must not pay. A step first compiled inside the
watch's first entry in a process is traced as before.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.optim import optimizer as optimizers
from torch.utils.hooks import RemovableHandle

from nan_magic.hot.checks.optimizer.step_layout import global_users_hooks, runs_user_hooks

__all__ = ["optimizer_step_hooks"]

_OURS = __name__.split(".")[0]

StepHook = Callable[[Any, Any, Any], None]


@contextmanager
def optimizer_step_hooks(pre: StepHook, post: StepHook, hooks_begin: StepHook, hooks_ran: StepHook
                         ) -> Iterator[None]:
    """``pre`` and ``post`` as global optimizer step pre- and post-hooks while the context is entered (seated on an
    optimizer whose step runs hooks of the user's, the module docstring: ``hooks_begin`` runs as its post-hook
    before the user's, ``hooks_ran`` as the global post-hook of such a step, once the user's have run)."""
    seats = _Seats(pre, post, hooks_begin, hooks_ran)
    hooks = (seats.global_pre, seats.global_post)
    handles = [optimizers.register_optimizer_step_pre_hook(hooks[0]),
               optimizers.register_optimizer_step_post_hook(hooks[1])]
    seats.global_post_id = handles[1].id
    seats.global_hooks = global_users_hooks()
    dynamo = sys.modules.get("torch._dynamo")
    callbacks = _compile_callbacks(dynamo)

    def opaque(*_args: Any) -> None:  # (torch 2.4's start callbacks take no argument, later ones one)
        """At each compile's start: each hook still registered bare for its ``disable``d self (once)."""
        _skip_ours(dynamo)  # (a reset may have come since the watch attached)
        for handle, hook in zip(handles, hooks, strict=True):
            registered = handle.hooks_dict_ref()
            if registered is not None and registered.get(handle.id) is hook:
                registered[handle.id] = _opaque(hook)
        # (It stays registered until the watch is left, a no-op: removed here, the callback run after it in
        # dynamo's list would be skipped.)

    if callbacks is not None:
        _skip_ours(dynamo)
        callbacks.register_start_callback(opaque)
    try:
        yield
    finally:
        if callbacks is not None and opaque in callbacks.start_callbacks:
            callbacks.remove_start_callback(opaque)
        for handle in handles:
            handle.remove()
        seats.leave()


class _Seats:
    """The watch's step hooks seated on the optimizers whose steps run hooks of the user's (module docstring)."""

    def __init__(self, pre: StepHook, post: StepHook, hooks_begin: StepHook, hooks_ran: StepHook) -> None:
        self.pre, self.post, self.hooks_begin, self.hooks_ran = pre, post, hooks_begin, hooks_ran
        #: The key of :meth:`global_post` among torch's global post-hooks: kept last, after the user's.
        self.global_post_id = -1
        #: Whether global step hooks of the user's were registered as the watch attached (one registered inside the
        #: watch is not looked for at each step: an optimizer of the user's hooks then seats it).
        self.global_hooks = False
        # id(optimizer) -> (the optimizer, weakly; its seated pre-hook's handle, its post-hook's)
        self._seated: dict[int, tuple[weakref.ref[Any], RemovableHandle, RemovableHandle]] = {}

    def global_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        __tracebackhide__ = True  # (as the hook's: an interrupt shows the user's frames)
        # (The usual step, no hook of the user's anywhere: fields read, no call.)
        if (self._seated or self.global_hooks or opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks) and (
                self._seat(opt)):
            return
        self.pre(opt, args, kwargs)

    def global_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        __tracebackhide__ = True
        if self._seated and (seat := self._seated.get(id(opt))) is not None and seat[0]() is opt:
            self.hooks_ran(opt, args, kwargs)
        else:
            self.post(opt, args, kwargs)

    def _seat(self, opt: Any) -> bool:
        """Whether ``opt``'s step checks run from its seated hooks: seated now where its step runs the user's hooks,
        and kept at their places (the pre-hook last, the post-hook first) where the user has added some since."""
        seat = self._seated.get(id(opt))
        if seat is not None and (seat[1].id not in getattr(opt, "_optimizer_step_pre_hooks", ())
                                 or seat[2].id not in getattr(opt, "_optimizer_step_post_hooks", ())
                                 or seat[0]() is not opt):
            # (Another optimizer at a freed one's id, or hook dicts the loop cleared, private as they are: seated
            # afresh where hooks of the user's are left, else checked as a step with none.)
            seat[1].remove()
            seat[2].remove()
            del self._seated[id(opt)]
            seat = None
        if seat is None:
            pres = getattr(opt, "_optimizer_step_pre_hooks", None)
            posts = getattr(opt, "_optimizer_step_post_hooks", None)
            # (A custom optimizer's plain dicts: nothing can be put first in them; its step is checked as before.)
            if not (type(pres) is OrderedDict and type(posts) is OrderedDict and runs_user_hooks(opt)):
                return False
            dynamo = sys.modules.get("torch._dynamo") is not None  # (a compiled step: called, not traced)
            seat = (weakref.ref(opt), opt.register_step_pre_hook(_opaque(self.pre) if dynamo else self.pre),
                    opt.register_step_post_hook(_opaque(self.hooks_begin) if dynamo else self.hooks_begin))
            self._seated[id(opt)] = seat
        _opt, pre, post = seat
        opt._optimizer_step_pre_hooks.move_to_end(pre.id)
        opt._optimizer_step_post_hooks.move_to_end(post.id, last=False)
        # (After a global post-hook the user registered since the watch attached, which would run after it; moved
        # now, not while torch iterates the post-hooks.)
        global_posts: Any = optimizers._global_optimizer_post_hooks  # (an OrderedDict, typed as a dict)
        if self.global_post_id in global_posts:
            global_posts.move_to_end(self.global_post_id)
        return True

    def leave(self) -> None:
        """The watch is left: every seated hook goes."""
        seated, self._seated = self._seated, {}
        for _opt, pre, post in seated.values():
            pre.remove()
            post.remove()


def _compile_callbacks(dynamo: Any) -> Any:
    """Dynamo's compile-start callbacks, where this torch has them as 2.13 does (None: the hooks stay bare, traced
    as before; ``torch>=2.4`` is supported, and these are private)."""
    handler = getattr(getattr(dynamo, "callback", None), "callback_handler", None)
    if not all(hasattr(handler, name) for name in ("register_start_callback", "remove_start_callback",
                                                   "start_callbacks")):
        return None
    return handler


def _skip_ours(dynamo: Any) -> None:
    """Dynamo passes over every frame of nan_magic's, once and for all (its skip list, as for numpy's).

    The watch's code runs inside a compiled function's call in more places than the step hooks: the loop-code
    recorders' ``__torch_dispatch__`` (their update region is open as a compiled step starts) sees the compiled
    graph's ops, and without this dynamo compiles their frames as frames of their own (graph breaks naming
    ``_nan_magic_update``, guards on their arguments). A skipped frame runs as it is; the skip list is read only
    while dynamo converts a frame, so an eager loop pays nothing.
    """
    rules: Any = getattr(dynamo, "trace_rules", None)
    try:
        if not rules.check_file(__file__).skipped:
            rules.add(_OURS)
    except (AttributeError, TypeError):  # (another torch's private trace rules: the frames are traced as before)
        pass


def _opaque(hook: StepHook) -> StepHook:
    """``hook`` as ``torch._dynamo.disable(hook)`` makes it, in one Python call and two builtin ones (torch's:
    ten): dynamo calls it rather than tracing it (the attributes), and nothing it runs is converted by dynamo
    (no eval-frame callback while it runs; torch's wrapper sets the stance's callback for ``None`` too, which is
    ``None`` in every stance)."""
    from torch._C._dynamo.eval_frame import set_eval_frame

    @functools.wraps(hook)
    def opaque(opt: Any, args: Any, kwargs: Any) -> None:
        __tracebackhide__ = True  # (as the hook's: an interrupt shows the user's frames)
        prior = set_eval_frame(None)
        try:
            return hook(opt, args, kwargs)
        finally:
            set_eval_frame(prior)

    opaque._torchdynamo_disable = True  # type: ignore[attr-defined]
    opaque._torchdynamo_disable_msg = None  # type: ignore[attr-defined]
    opaque._torchdynamo_disable_recursive = True  # type: ignore[attr-defined]
    opaque._torchdynamo_orig_callable = hook  # type: ignore[attr-defined]
    return opaque
