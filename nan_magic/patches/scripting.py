"""``torch.jit.script(model)`` inside a watch, with the watch's hook on the model taken off while it compiles.

The tiered watch puts a forward hook on a model it steps aside for (hot/watched/module_hooks.py's
``_ModelReturned``; a deep copy of the model carries a stand-in), and ``torch.jit.script`` compiles a module's
forward hooks with its forward: ours is Python TorchScript cannot compile (no ``__name__``, untyped arguments), and
the user's scripting raised an error the watch caused. So ``torch.jit.script`` is wrapped while a watch is active:
for the call, our hooks come off every submodule of a module being scripted and go back after it (where the hook
dict is as we left it; a hook the user added meanwhile stays, after ours). The scripted module carries none of
ours and runs unwatched by that hook; the eager model keeps it and stays watched.

``torch.jit.trace`` and ``trace_module`` run the model on sizes the tracer follows as tensors, and the watch's
boundary reads ask them questions (``0 in value.shape``): each asks TracerWarning's "converting a tensor to a
Python boolean", about 30 lines of warnings a trace, all pointing into nan_magic, none about the user's graph (the
reads add nothing to it). For those calls (and ``torch.jit._get_trace_graph``, the TorchScript ONNX exporter's)
TracerWarnings raised from nan_magic's own modules are ignored; the user's stay. And the watch steps aside for the
call (:func:`aside_while_tracing`): a traced call is an export, no training step, and what the hooks read went into
the graph of the first trace only, so torch's check of it (the call traced again) failed with "Graphs differed
across invocations" in the user's ``torch.jit.trace(model, x)``. (``warnings.catch_warnings``
swaps the process's filter list for the call, as any library's use of it does: a filter another thread adds
during the trace does not outlive it.)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nan_magic.hot.watched.module_hooks import is_watch_hook
from nan_magic.patches.registry import ProcessPatch, Recorder, call_aside

__all__ = ["aside_while_tracing", "quiet_tracing", "unhooked_scripting"]

#: The watches that step aside while a trace runs (aside_while_tracing).
_tracing: list[Recorder] = []

def _take_off(module: nn.Module) -> list[tuple[dict[int, Any], dict[int, Any], dict[int, Any]]]:
    """Our hooks off ``module`` and its submodules: (each hook dict, as it was, as it is left)."""
    taken = []
    for submodule in module.modules():
        hooks = submodule._forward_hooks
        if any(is_watch_hook(hook) for hook in hooks.values()):
            before = dict(hooks)
            for key in [key for key, hook in before.items() if is_watch_hook(hook)]:
                del hooks[key]
            taken.append((hooks, before, dict(hooks)))
    return taken


def _put_back(taken: list[tuple[dict[int, Any], dict[int, Any], dict[int, Any]]]) -> None:
    for hooks, before, left in taken:
        current = dict(hooks)  # (a hook the user removed meanwhile stays removed)
        added = {key: hook for key, hook in current.items() if key not in left}
        hooks.clear()
        hooks.update({key: hook for key, hook in before.items() if is_watch_hook(hook) or key in current})
        hooks.update(added)  # (a hook registered while scripting: after ours, as registered after them)


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def script(obj: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if not isinstance(obj, nn.Module):
            return original(obj, *args, **kwargs)
        taken = _take_off(obj)
        try:
            return original(obj, *args, **kwargs)
        finally:
            _put_back(taken)

    return script


_PATCH = ProcessPatch.of(torch.jit, "script", _wrap)


@contextmanager
def unhooked_scripting() -> Iterator[None]:
    """Inside the block, ``torch.jit.script`` of a module compiles it without the watch's hooks (the module
    docstring)."""
    with _PATCH.held():
        yield


def _wrap_trace(original: Callable[..., Any]) -> Callable[..., Any]:
    def trace(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        with warnings.catch_warnings():
            # (``module`` is matched against the module the warning is attributed to: ours, not the user's.)
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=r"nan_magic\.")
            return call_aside(_tracing, original, *args, **kwargs)

    return trace


_TRACE = ProcessPatch.of(torch.jit, "trace", _wrap_trace)
_TRACE_MODULE = ProcessPatch.of(torch.jit, "trace_module", _wrap_trace)
_TRACE_GRAPH = ProcessPatch.of(torch.jit, "_get_trace_graph", _wrap_trace)  # (the TorchScript ONNX exporter's)


@contextmanager
def quiet_tracing() -> Iterator[None]:
    """Inside the block, ``torch.jit.trace`` and ``trace_module`` leave out the TracerWarnings the watch's own
    reads raise (the module docstring)."""
    with _TRACE.held(), _TRACE_MODULE.held(), _TRACE_GRAPH.held():
        yield


@contextmanager
def aside_while_tracing(recorder: Recorder) -> Iterator[None]:
    """Inside the block, ``recorder`` steps aside for each ``torch.jit.trace``, ``trace_module`` and
    ``_get_trace_graph`` call and back after it (the module docstring)."""
    with _TRACE.held((_tracing, recorder)), _TRACE_MODULE.held(), _TRACE_GRAPH.held():
        yield
