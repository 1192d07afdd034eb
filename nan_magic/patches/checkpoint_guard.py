"""Healthy-checkpoint guard: warn before ``torch.save`` writes non-finite values.

A checkpoint saved after a run went bad silently replaces the last good one,
and the damage shows only when it is loaded days later. While the guard is
on, ``torch.save`` first looks at what it is given (tensors, modules,
optimizers, and dicts, lists and tuples of them, to a bounded depth) and
emits a :class:`~nan_magic.NanMagicWarning` naming every entry that holds
NaN or infinity, then saves as asked.

Only calls through the attribute ``torch.save`` are seen: code that did
``from torch import save`` before the guard was enabled keeps the original.
Checking costs one reduction per tensor and a host synchronisation per
tensor on a GPU, which is small next to writing the file.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn

from nan_magic.errors.exceptions import NanMagicWarning
from nan_magic.hot.reads import is_checkable
from nan_magic.hot.stats import kinds_of, tensor_stats
from nan_magic.patches.registry import ProcessPatch
from nan_magic.records import KINDS

__all__ = ["CheckpointGuard", "guard_checkpoints", "nonfinite_entries"]

#: Entries named in one warning; the rest are counted.
MAX_NAMED = 10


class CheckpointGuard:
    """An enabled guard (see :func:`guard_checkpoints`); :meth:`disable` or leave its ``with`` block."""

    def __init__(self) -> None:
        self.enabled = False

    def enable(self) -> CheckpointGuard:
        """Wrap ``torch.save`` (once for all guards that are on)."""
        if not self.enabled:
            _PATCH.acquire()
            self.enabled = True
        return self

    def disable(self) -> None:
        """Put ``torch.save`` back once no guard is on (unless someone replaced it since: patches.py)."""
        if self.enabled:
            self.enabled = False
            _PATCH.release()

    def __enter__(self) -> CheckpointGuard:
        return self.enable()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.disable()


def guard_checkpoints() -> CheckpointGuard:
    """Warn whenever ``torch.save`` is about to write non-finite parameters or state.

    Returns
    -------
    CheckpointGuard
        Already enabled: use it as a context manager (off again at the end of
        the block) or call ``.disable()``.

    Examples
    --------
    >>> with nan_magic.guard_checkpoints():           # doctest: +SKIP
    ...     torch.save(model.state_dict(), "ckpt.pt")  # NanMagicWarning if any entry is NaN/inf
    >>> guard = nan_magic.guard_checkpoints()  # for the rest of the session  # doctest: +SKIP
    >>> guard.disable()                                # doctest: +SKIP
    """
    return CheckpointGuard().enable()


def _guarded(save: Callable[..., Any]) -> Callable[..., Any]:
    def save_checked(obj: Any, *args: Any, **kwargs: Any) -> Any:
        bad = nonfinite_entries(obj)
        if bad:
            named = [f"{name} ({count})" for name, count in bad[:MAX_NAMED]]
            more = f" and {len(bad) - MAX_NAMED} more" if len(bad) > MAX_NAMED else ""
            # stacklevel 3: past the patch's dispatch (patches.py), the warning points at the user's torch.save line.
            warnings.warn(
                f"torch.save is about to write non-finite values: {', '.join(named)}{more}",
                NanMagicWarning,
                stacklevel=3,
            )
        return save(obj, *args, **kwargs)

    return save_checked


_PATCH = ProcessPatch.of(torch, "save", _guarded)


def nonfinite_entries(obj: Any) -> list[tuple[str, str]]:
    """``(name, counts)`` of every floating tensor in ``obj`` that holds NaN or infinity.

    Names join string keys with dots and show other keys in brackets:
    ``"model.fc.weight"``, ``"optimizer.state[0].exp_avg"``.
    """
    found = []
    for name, tensor in _tensors(obj, ""):
        if kinds_of(tensor):
            stats = tensor_stats(tensor)
            counts = ", ".join(
                f"{count} {kind}" for kind, count in zip(KINDS, (stats.nan, stats.posinf, stats.neginf)) if count
            )
            found.append((name or "tensor", counts))
    return found


def _tensors(value: Any, path: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        if is_checkable(value):
            yield path, value
        return
    if depth > 6:
        return
    if isinstance(value, nn.Module):
        for name, tensor in value.state_dict().items():
            yield from _tensors(tensor, _join(path, name), depth + 1)
    elif isinstance(value, torch.optim.Optimizer):
        yield from _tensors(value.state_dict(), path, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            name = _join(path, key) if isinstance(key, str) else f"{path}[{key!r}]"
            yield from _tensors(item, name, depth + 1)
    elif type(value) in (list, tuple):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{path}[{index}]", depth + 1)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
