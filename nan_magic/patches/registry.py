"""Process-wide patches: one place installs them and one rule takes them back.

Some things the watch must see have no hook in torch: the tensor
``backward()`` starts from, a GradScaler's ``scale`` and ``step``,
``torch.save`` (the checkpoint guard), the optimizers and scalers a script
constructs (the command line adopts them), a reentrant checkpoint during a
backward replay, ``zero_grad()`` (run with the loop-code recorder stepped
aside), the end of an ``inference_mode`` block (the Python dispatch key put
back in step with the dispatch-mode stack), a ``TorchDispatchMode`` the
user enters inside the watch (its handler gated against the watch's ops),
``torch.jit.script`` of a module (compiled without the watch's hook on it),
``torch.jit.trace`` (without the TracerWarnings of the watch's own reads),
``torch.utils.swap_tensors`` (nothing of the watch's holding the two tensors), ``load_state_dict`` (the line that
loaded a non-finite value).
Each is seen by replacing an attribute of a class or module for as
long as someone needs it, and every such replacement is a
:class:`ProcessPatch`:

* it is installed when its first holder takes it and taken back when its
  last holder lets go (counted under a lock: holders may be on several
  threads, and a watch may be nested in another);
* it is taken back only if the attribute still holds our replacement. A user
  (or another library) that patched the same attribute after us wrapped
  ours: putting the original back would silently drop their patch. Theirs
  stays, and ours goes inert: from then on it only calls what it replaced.

:func:`installed` lists what is installed now, so that tests can check that
nothing is left after a watch, however it ended.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ProcessPatch", "Recorder", "SelfGated", "Wrap", "brought_back", "call_aside",
           "installed", "stepped_aside"]

#: ``wrap(original) -> replacement``: the replacement receives what the original would, and calls it.
Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


class SelfGated:
    """A wrap whose replacement reads whether it still acts itself: ``wrap(original, entry)``, the replacement
    calling ``original`` alone where ``entry.acting`` is False. It is installed as it is, without the dispatch
    frame between the caller and it: a warning torch gives from below with a stacklevel counted for its own frames
    (``Tensor.backward``'s: a full backward hook's, stacklevel=5) then names the caller's line, not ours."""

    def __init__(self, wrap: Callable[[Callable[..., Any], Any], Callable[..., Any]]) -> None:
        self.wrap = wrap

_MISSING = object()
_live: list[ProcessPatch] = []


class _Installed:
    """One attribute replaced: what we set, what was there, and whether ours still acts."""

    def __init__(self, owner: Any, name: str, wrap: Wrap | SelfGated,
                 absent: Callable[..., Any] | None = None) -> None:
        self.owner, self.name = owner, name
        # What the replacement calls: the attribute as code reads it (a classmethod comes bound), or ``absent``
        # where the owner has none (what the caller does then: patches/copies.py's ``__copy__``).
        original = getattr(owner, name) if absent is None else getattr(owner, name, absent)
        # What goes back: the owner's own entry, or nothing when the attribute was inherited.
        self.previous = vars(owner).get(name, _MISSING)
        self.acting = True
        dispatch: Callable[..., Any]
        if isinstance(wrap, SelfGated):
            dispatch = functools.update_wrapper(wrap.wrap(original, self), original)
        else:
            replacement = wrap(original)

            @functools.wraps(original)
            def dispatch(*args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                return (replacement if self.acting else original)(*args, **kwargs)

        # A bound original (classmethod) or a staticmethod takes no instance: ours must not either.
        static = inspect.getattr_static(owner, name, None)
        self.value: Any = staticmethod(dispatch) if isinstance(static, (classmethod, staticmethod)) else dispatch
        setattr(owner, name, self.value)

    def take_back(self) -> None:
        if vars(self.owner).get(self.name, _MISSING) is self.value:
            if self.previous is _MISSING:
                delattr(self.owner, self.name)
            else:
                setattr(self.owner, self.name, self.previous)
        else:
            # Someone patched it after us and wraps ours: leave theirs, make ours a pass-through.
            self.acting = False


class ProcessPatch:
    """Attributes replaced while at least one holder holds the patch.

    Parameters
    ----------
    plan
        Called at each installation: the ``(owner, name, wrap)`` of every
        attribute to replace (or ``(owner, name, wrap, absent)``: ``absent``
        stands for an attribute the owner lacks) (computed then, so that it may depend on what
        exists at that time, e.g. the subclasses imported so far).
    """

    def __init__(self, plan: Callable[[], Iterable[tuple[Any, ...]]]) -> None:
        self._plan = plan
        self._lock = threading.Lock()
        self._holders = 0
        self._installed: list[_Installed] = []

    @classmethod
    def of(cls, owner: Any, name: str, wrap: Wrap, absent: Callable[..., Any] | None = None) -> ProcessPatch:
        """The patch of one attribute (``absent``: what ``wrap`` is given where the owner has no such attribute)."""
        return cls(lambda: [(owner, name, wrap, absent)])

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0:
                try:
                    for owner, name, wrap, *absent in self._plan():
                        self._installed.append(_Installed(owner, name, wrap, *absent))
                except BaseException:
                    self._take_back()
                    raise
                _live.append(self)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                raise RuntimeError("release() of a patch that is not held")
            self._holders -= 1
            if self._holders == 0:
                _live.remove(self)
                self._take_back()

    @contextmanager
    def held(self, *entries: tuple[list[Any], Any]) -> Iterator[None]:
        """Hold the patch for the duration of the block, however it ends, with each ``(registry, item)`` of
        ``entries`` appended to its registry (a list the replacements read) meanwhile."""
        self.acquire()
        for registry, item in entries:
            registry.append(item)
        try:
            yield
        finally:
            for registry, item in entries:
                registry.remove(item)
            self.release()

    def _take_back(self) -> None:
        while self._installed:  # last installed first, in case two entries touch one owner
            self._installed.pop().take_back()

    def targets(self) -> list[tuple[Any, str]]:
        """The ``(owner, name)`` of every attribute replaced now."""
        return [(entry.owner, entry.name) for entry in self._installed]


#: ``(step_aside, step_back)`` of a recorder that steps aside around a patched call: ``step_aside()`` says
#: whether it did (patches/zero_grad.py, patches/loaders.py).
Recorder = tuple[Callable[[], bool], Callable[[], None]]


def call_aside(recorders: list[Recorder], original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``original(*args, **kwargs)`` with each of ``recorders`` stepped aside where it says it did, and brought
    back after, innermost first."""
    __tracebackhide__ = True
    # (stepped_aside's and brought_back's bodies here: two calls less, at every zero_grad())
    aside: list[Callable[[], None]] = []
    for step_aside, back in recorders:  # (a loop and +=, not a comprehension: its call, at every zero_grad())
        if step_aside():
            aside += (back,)
    try:
        return original(*args, **kwargs)
    finally:
        for back in aside[::-1]:  # (a slice, not reversed(): no call)
            back()


def stepped_aside(recorders: list[Recorder]) -> list[Callable[[], None]]:
    """Each of ``recorders`` stepped aside; what brings back those that say they did (:func:`brought_back`)."""
    aside: list[Callable[[], None]] = []
    for step_aside, back in recorders:  # (a loop and +=, not a comprehension: its call, at every zero_grad())
        if step_aside():
            aside += (back,)
    return aside


def brought_back(aside: list[Callable[[], None]]) -> None:
    """The recorders :func:`stepped_aside` stepped aside brought back, innermost first."""
    for back in aside[::-1]:  # (a slice, not reversed(): no call)
        back()


def installed() -> list[tuple[Any, str]]:
    """Every attribute replaced by nan_magic right now, as ``(owner, name)``."""
    return [target for patch in list(_live) for target in patch.targets()]
