"""The watch's two global module hooks, and how they step aside while a model runs.

Global hooks (``register_module_forward_pre_hook`` and
``register_module_forward_hook``) see every module call, and cost a few
microseconds each. The tiered watch checks only top-level calls of the
watched models, so on its boundary-only steps the hooks step aside while a
model's call runs (below): its submodules' calls then cost nothing.

A model compiled with ``torch.compile`` must always run *without* them: dynamo
traces the submodules' ``_call_impl``, so global hooks present while it
compiles break the graph at every submodule, and adding or removing them
later makes it recompile. So when a compiled model (an ``OptimizedModule``)
is called at top level, the pre-hook takes both global hooks off, and a hook
on that ``OptimizedModule`` (registered for the watch's lifetime) puts them
back when its call returns or raises, and runs the watch's post-hook for it.
The compiled graph therefore never sees a hook of ours: no graph break, no
recompile, and the watch checks the compiled call's inputs and outputs from
outside. An eager model steps aside the same way, except an
``nn.TransformerEncoderLayer`` called at top level: its fused inference path
is not taken while a hook sits on the layer itself. ``OptimizedModule.__call__`` warns when global hooks exist; that
one warning is filtered while the watch is active (our hooks are off by the
time the compiled code runs).

The full watch (``mode="full"``, ``ops=True``) must see every module call and
every op, which a compiled graph hides. At its first call of a compiled
model it sets dynamo's ``force_eager`` stance until the watch ends
(:meth:`GlobalModuleHooks.run_eagerly`), as a replay runs ``_orig_mod``: the
wrapper then calls the original module's code, under the hooks and the op
tracer. The stance only skips dynamo: the compiled code, its guards and
caches stay as they are, so nothing recompiles after the watch. It is
process-wide: while the watch is active, other ``torch.compile``d code (a
compiled loss, another thread's model) runs eagerly too. One
:class:`~nan_magic.NanMagicWarning` says so. The stance is the user's again
after the watch: the one from before it, or one they set inside it
(eager_stance.py).
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from torch import nn
from torch.nn.modules import module as module_registry
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from nan_magic.errors.exceptions import NanMagicWarning
from nan_magic.hot.watched.eager_stance import EagerStance, eager_stance

__all__ = ["SEES_ITS_HOOKS", "GlobalModuleHooks", "is_compiled", "is_watch_hook"]

_GLOBAL_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper (``OptimizedModule``)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without dynamo
        return False
    return isinstance(module, OptimizedModule)


#: Modules whose forward changes with a hook on themselves: TransformerEncoderLayer's fast path checks its own hooks.
SEES_ITS_HOOKS: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer,)


class GlobalModuleHooks:
    """The pre- and post-hook of one watch, attached globally, detachable around a compiled call."""

    def __init__(self, pre: Callable[..., None], post: Callable[..., None]) -> None:
        self.pre = pre
        self.post = post
        self._ids: tuple[int, int] | None = None  # the ids of our two entries in torch's registries
        self._attached = False
        self._wrapped: set[int] = set()
        self._stack: ExitStack | None = None
        self._eager: EagerStance | None = None
        self._noticed = False

    def attach(self, stack: ExitStack) -> None:
        """Attach the global hooks until ``stack`` closes."""
        self._stack = stack
        self._eager = None  # attached again after a nested watch took over: its stance went with the old stack
        self._on()
        stack.callback(self._off)
        # Inserted by hand: filterwarnings() would first remove an equal filter (an outer watch's, or
        # the user's own), which our exit would then take away.
        added = ("ignore", re.compile(_GLOBAL_HOOK_WARNING, re.I), UserWarning, None, 0)
        warnings.filters.insert(0, added)  # type: ignore[attr-defined]
        warnings._filters_mutated()  # type: ignore[attr-defined]
        stack.callback(_remove_filter, added)

    def step_aside_for(self, model: nn.Module) -> None:
        """Take the global hooks off while ``model`` runs; they come back when its call returns or raises."""
        self._off()
        if id(model) not in self._wrapped and self._stack is not None:
            self._wrapped.add(id(model))
            handle = model.register_forward_hook(_ModelReturned(self._model_returned), with_kwargs=True,
                                                 always_call=True)
            self._stack.callback(handle.remove)
            self._stack.callback(self._wrapped.discard, id(model))

    def run_eagerly(self, shown: str, mode: str | None, stacklevel: int) -> None:
        """Run compiled code eagerly until the watch ends: a full watch calls compiled model ``shown``.

        ``mode`` names the watch's mode in the one notice (None: a replay's
        watch, which the user did not ask for, says nothing).
        """
        if self._eager is not None:
            self._eager.again()  # where the user set a stance of their own since: theirs after the watch
            return
        if self._stack is None:
            return
        self._eager = self._stack.enter_context(eager_stance())
        if mode is not None and not self._noticed:
            self._noticed = True
            warnings.warn(
                f"nan_magic: {shown} is compiled with torch.compile; under {mode} it runs eagerly while the watch "
                "is active (hooks and the op tracer cannot see inside a compiled graph), compiled again after it",
                NanMagicWarning, stacklevel=stacklevel + 1,
            )

    def _model_returned(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
                        ) -> None:
        __tracebackhide__ = True  # an interrupt landing in a watch hook: IPython shows the user's frames, not ours
        if self._stack is None or self._attached:
            return  # a call made before the watch stepped aside (or after it ended)
        self._on()
        if output is None and sys.exc_info()[1] is not None:
            self.post(module, args, output)  # the always_call form of a call that raised
        else:
            self.post(module, args, kwargs, output)

    def _on(self) -> None:
        if self._attached:
            return
        if self._ids is None:
            pre = register_module_forward_pre_hook(self.pre)
            post = register_module_forward_hook(self.post, with_kwargs=True, always_call=True)
            self._ids = (pre.id, post.id)
        else:
            # Back under the ids torch gave them: the entries its registration makes, without two handle objects
            # and their weak references at every top-level call (the hooks come and go each step).
            pre_id, post_id = self._ids
            module_registry._global_forward_pre_hooks[pre_id] = self.pre
            module_registry._global_forward_hooks[post_id] = self.post
            module_registry._global_forward_hooks_with_kwargs[post_id] = True
            module_registry._global_forward_hooks_always_called[post_id] = True
        self._attached = True

    def _off(self) -> None:
        if not self._attached or self._ids is None:
            return
        pre_id, post_id = self._ids
        # Every entry, as a handle's remove() would, and the kwargs flag, which it forgets (torch 2.13): an entry
        # left there keeps ``_has_any_global_hook()`` true, and OptimizedModule warning, after the watch. (``del``
        # where present, not ``pop``: no call, at every top-level call.)
        if pre_id in (pre_hooks := module_registry._global_forward_pre_hooks):
            del pre_hooks[pre_id]
        for registry in (module_registry._global_forward_hooks, module_registry._global_forward_hooks_with_kwargs,
                         module_registry._global_forward_hooks_always_called):
            if post_id in registry:
                del registry[post_id]
        self._attached = False


class _ModelReturned(functools.partial):
    """The hook on a model the watch steps aside for, as a copy of the model sees it.

    ``copy.deepcopy(model)`` (an EMA teacher, the best weights so far) or ``torch.save(model)`` while the watch is
    active copies the model's hooks, ours with them: the watch behind it cannot be copied or pickled (a generator,
    weak references), and the user's copy failed. While the watch is active ``nn.Module.__reduce_ex__`` leaves ours
    out of the copy (patches/copies.py). Where a class bypasses it (its own ``__deepcopy__`` or ``__reduce_ex__``),
    ours copies as a stand-in that runs nothing (:class:`_LeftByACopy`, gone at the copy's first call), and pickles
    as an inert hook of the standard library, so that loading the file needs no nan_magic.

    A :class:`functools.partial` of :meth:`GlobalModuleHooks._model_returned`: called, it calls that method from C,
    with no Python frame of its own between torch's hook call and the watch's (every top-level call returns here).
    """

    def __deepcopy__(self, memo: dict[int, Any]) -> _LeftByACopy:
        return _LeftByACopy()

    def __reduce__(self) -> tuple[Any, ...]:
        return _INERT


#: How our hooks pickle: a hook that returns None and reads nothing, made of the standard library only.
_INERT = functools.partial, (sys.audit, "nan_magic.hook_left_by_a_copy")


class _LeftByACopy:
    """What a deep copy of a watched model carries in place of the watch's hook: its first call takes it off (a
    copy of the copy, saved before that call, pickles as :data:`_INERT`, as the hook it stands for)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _INERT

    def __call__(self, module: nn.Module, *args: Any) -> None:
        for key, hook in list(module._forward_hooks.items()):
            if hook is self:  # (torch iterates a tuple of its hooks: removing one while they run is safe)
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)


def is_watch_hook(hook: Any) -> bool:
    """Whether a module's forward hook is the watch's (or a copy's stand-in for it): taken off while
    ``torch.jit.script`` compiles the module (patches/scripting.py)."""
    return isinstance(hook, (_ModelReturned, _LeftByACopy))


def _remove_filter(added: Any) -> None:
    """Remove this very filter (an equal one, another watch's, stays); gone already if the filters were reset."""
    for index, entry in enumerate(warnings.filters):
        if entry is added:
            del warnings.filters[index]  # type: ignore[attr-defined]
            break
    warnings._filters_mutated()  # type: ignore[attr-defined]
