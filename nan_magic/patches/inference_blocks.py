"""``torch.inference_mode`` blocks that end with torch's Python dispatch key as the dispatch-mode stack says.

torch's inference-mode guard saves this thread's whole dispatch-key set as its
block begins and puts it back as the block ends. The Python key in that set is
on exactly while a dispatch mode is on the stack: pushing a mode onto an empty
stack puts it on, popping the last one puts it off. A mode pushed before the
block and popped inside it (the loop code's recorder, localize/outside/
recorder.py, steps aside as the evaluation's model call begins) leaves the key
on over an empty stack after the block, and every op then fails in torch's
Python fallback; one pushed inside the block and still on the stack after it
finds the key off, and sees no op. So while a watch records the loop's code,
``inference_mode.__exit__`` puts the key back in step with the stack after
torch's exit, and the recorder may step aside and back inside a block as it
does outside one: an evaluation's model calls run with no dispatch mode on the
stack, at an unwatched evaluation's cost.

``torch.inference_mode()`` as a ``with`` block and as a decorator (which enters
a fresh instance around each call: ``torch.utils._contextlib``) both reach the
patched methods. ``torch._C._InferenceMode`` entered directly (torch's own
``_enter_inference_mode``, which compiled graphs call) does not: the recorder
keeps from pushing or popping where inference mode is not as the innermost
block seen here, or the watch, set it (:func:`as_blocks_set`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.grad_mode import inference_mode

from nan_magic.patches.registry import ProcessPatch

__all__ = ["BLOCKS", "as_blocks_set", "balanced_inference_blocks"]

_depth = torch._C._len_torch_dispatch_stack
_inference = torch.is_inference_mode_enabled
_key_on, _set_key = torch._C._dispatch_tls_is_dispatch_key_included, torch._C._dispatch_tls_set_dispatch_key_included
_PYTHON, _PYTHON_SNAPSHOT = torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot


class _Blocks(threading.local):
    """This thread's ``inference_mode`` blocks entered under the patch and not yet left, innermost last."""

    def __init__(self) -> None:
        self.open: list[tuple[inference_mode, bool]] = []  # (the block, its mode)


_blocks = _Blocks()
#: This thread's open blocks, for a caller on the hot path that inlines :func:`as_blocks_set` (recorder.py).
BLOCKS = _blocks


def as_blocks_set(outside: bool) -> bool:
    """Whether inference mode is on as the innermost open block entered under the patch set it, or as ``outside``
    (the watch's own state) where none is open: where it is not, a guard entered directly is open, whose end puts
    the key set back unseen, and a dispatch mode may be neither pushed nor popped."""
    open_blocks = _blocks.open
    return _inference() == (open_blocks[-1][1] if open_blocks else outside)


def _in_step() -> None:
    """The Python key (and its TLS snapshot's) on exactly while a dispatch mode is on this thread's stack."""
    on = _depth() > 0
    if _key_on(_PYTHON) != on:
        _set_key(_PYTHON, on)
        _set_key(_PYTHON_SNAPSHOT, on)


def _wrap_enter(original: Callable[..., Any]) -> Callable[..., Any]:
    def __enter__(self: inference_mode) -> Any:
        __tracebackhide__ = True
        entered = original(self)
        _blocks.open.append((self, bool(self.mode)))
        return entered

    return __enter__


def _wrap_exit(original: Callable[..., Any]) -> Callable[..., Any]:
    def __exit__(self: inference_mode, *exc: Any) -> Any:
        __tracebackhide__ = True
        open_blocks = _blocks.open
        index = next((i for i in range(len(open_blocks) - 1, -1, -1) if open_blocks[i][0] is self), None)
        try:
            return original(self, *exc)
        finally:
            if index is not None:  # (a block entered before the patch, or on another thread: as torch left it)
                del open_blocks[index:]
                _in_step()

    return __exit__


_PATCH = ProcessPatch(lambda: [(inference_mode, "__enter__", _wrap_enter), (inference_mode, "__exit__", _wrap_exit)])


@contextmanager
def balanced_inference_blocks() -> Iterator[None]:
    """Inside the block, every ``torch.inference_mode`` block ends with the Python key in step with the stack."""
    with _PATCH.held():
        yield
