"""Callbacks at the start and end of each dynamo compile, kept through ``torch._dynamo.reset()``.

The watch takes its global module hooks off while dynamo compiles (hot/watched/module_hooks.py
``GlobalModuleHooks.compile_started``): dynamo would trace them, one graph break at every submodule of a module it
inlines, which inside a ``torch.func`` transform it cannot resume from. Dynamo's compile callbacks say when; but
``torch._dynamo.reset()`` (``torch.compiler.reset()``: a sweep over configurations, a notebook re-run) clears every
callback, and a function compiled after it in the same watch met the hooks again. So ``reset`` is wrapped while a
watch holds callbacks here: after it, they are registered again. Where dynamo is not loaded, or its private
callbacks are not 2.13's, nothing is registered (the hooks are traced as before).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from nan_magic.patches.registry import ProcessPatch

__all__ = ["kept_compile_callbacks"]

Callback = Callable[..., None]  # (torch 2.4's callbacks take no argument, later ones one)

_kept: list[tuple[Callback, Callback]] = []  # each watch's (start, end), outermost first


def _handler() -> Any:
    """Dynamo's compile callbacks where it is loaded and has them as 2.13 does; else None."""
    handler = getattr(getattr(sys.modules.get("torch._dynamo"), "callback", None), "callback_handler", None)
    names = ("register_start_callback", "register_end_callback", "remove_start_callback", "remove_end_callback",
             "start_callbacks", "end_callbacks")
    return handler if all(hasattr(handler, name) for name in names) else None


def _register(handler: Any, start: Callback, end: Callback) -> None:
    if start not in handler.start_callbacks:
        handler.register_start_callback(start)
    if end not in handler.end_callbacks:
        handler.register_end_callback(end)


def _wrap_reset(original: Callable[..., Any]) -> Callable[..., Any]:
    def reset(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        result = original(*args, **kwargs)
        handler = _handler()
        if handler is not None:
            for start, end in list(_kept):
                _register(handler, start, end)
        return result

    return reset


_RESET = ProcessPatch(lambda: [(sys.modules["torch._dynamo"], "reset", _wrap_reset)])


@contextmanager
def kept_compile_callbacks(start: Callback, end: Callback) -> Iterator[None]:
    """``start()`` as each dynamo compile starts and ``end()`` as it ends, for the duration of the block, a
    ``torch._dynamo.reset()`` inside it included."""
    handler = _handler()
    if handler is None:
        yield
        return
    _register(handler, start, end)
    try:
        with _RESET.held((_kept, (start, end))):
            yield
    finally:
        handler = _handler() or handler
        if end in handler.end_callbacks:
            handler.remove_end_callback(end)
        if start in handler.start_callbacks:
            handler.remove_start_callback(start)
