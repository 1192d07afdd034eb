"""Norm layers' running statistics that a failing step has already made non-finite, named at the first event.

A batch norm in training mode folds each batch's mean and variance into ``running_mean`` and ``running_var`` as its
forward runs. Where a non-finite value reached it before the watch stopped the step (a NaN batch, which the watch
holds for its step to tell it from one the model handles; any event the deferred check finds after the forward),
those buffers hold NaN from then on, in the user's model: evaluation mode normalises by them, and the momentum never
washes it out. The watch did not write them and cannot know what they held before, so the report says so,
and how to put them back. Read once, at the first real event: no cost on a healthy step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["nonfinite_norm_stats"]

_STATS = ("running_mean", "running_var")


def nonfinite_norm_stats(roots: Iterable[tuple[str | None, nn.Module]]) -> tuple[str, ...]:
    """The running statistics of every norm layer under ``roots`` (``(label, model)``) that hold a non-finite value:
    ``1.running_mean``, or ``D.1.running_var`` where several models are watched."""
    roots = list(roots)
    found: list[str] = []
    for label, root in roots:
        prefix = f"{label}." if len(roots) > 1 and label else ""
        for name, module in root.named_modules():
            if not isinstance(module, nn.modules.batchnorm._NormBase):
                continue
            for stat in _STATS:
                if _nonfinite(module._buffers.get(stat)):
                    found.append(f"{prefix}{name}.{stat}" if name else f"{prefix}{stat}")
    return tuple(found)


def _nonfinite(buffer: object) -> bool:
    """Whether a buffer holds a non-finite value; False for one that cannot be read (a lazy module's uninitialized
    buffer, one on the meta device): a note never costs the report."""
    if not isinstance(buffer, torch.Tensor) or buffer.device.type == "meta":
        return False
    try:
        return buffer.is_floating_point() and not bool(torch.isfinite(buffer).all())
    except (RuntimeError, ValueError, TypeError):
        return False
