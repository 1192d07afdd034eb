"""Which parameters a model's forward writes in place, learned at its first call, for a replay of its step.

A step replay runs a top-level call again from what the call found (replay/tiered/step.py). A forward that writes
its own parameter in place (a max-norm constraint renormalising its weight rows under ``no_grad``, an
``nn.Embedding(max_norm=...)`` renormalising the rows it looks up, Glow's ActNorm setting its scale from the first
batch) leaves the parameter as the write made it: a replay from there meets a NaN the write put in and cannot name
the op that made it. So the values those parameters had before each call are kept, as a BatchNorm's buffers are.

Which parameters: those whose version counter a model's first call (in training, and again in eval mode) moved, or
whose norm it changed (a write through ``.data`` moves no version counter). Learned once per model and mode, so a
model whose forward writes no parameter (almost every one) pays nothing after its first call; one that writes some
pays a copy of those at each call. Not learned: a write the first call skips (``if norm > max_norm: w.data.mul_(…)``
through ``.data``, under the limit then), or one that leaves the norm as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nan_magic.hot.kept.buffer_copies import with_versions
from nan_magic.hot.reads import GradOff, unreadable_reason, version_of

__all__ = ["Learning", "Written", "written_parameters_after", "written_parameters_before"]

#: The parameters a model's forward writes in place (an empty tuple for almost every model).
Written = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Learning:
    """What a model's first call in a mode noted of its parameters as it began."""

    training: bool
    versions: list[tuple[torch.Tensor, int]]
    #: Each parameter's norm (None where it cannot be had: a parameter that is not a plain dense tensor).
    norms: list[torch.Tensor] | None


def written_parameters_before(module: nn.Module, training: bool) -> Learning:
    """Note ``module``'s parameters as its first call in this mode begins (read again by the next function)."""
    parameters: list[torch.Tensor] = list(module.parameters())
    return Learning(training, with_versions(parameters), _norms(parameters))


def written_parameters_after(learning: Learning) -> tuple[bool, Written]:
    """The call returned: its mode, and the parameters it wrote (version counter moved, or norm changed)."""
    moved = [version_of(parameter) != version for parameter, version in learning.versions]
    if learning.norms is not None and not all(moved):
        now = _norms([parameter for parameter, _version in learning.versions])
        if now is not None:
            with GradOff():
                before, after = torch.stack(learning.norms), torch.stack(now)
                changed = ((before != after) & ~(before.isnan() & after.isnan())).tolist()  # (one host read, once)
            moved = [was or norm for was, norm in zip(moved, changed)]
    return learning.training, tuple(
        parameter for (parameter, _version), wrote in zip(learning.versions, moved) if wrote
    )


def _norms(parameters: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Each parameter's norm in float32 (one fused op per device and dtype); None for a parameter without one."""
    if not parameters or any(
        type(p) is not nn.Parameter
        or p.layout is not torch.strided
        or p.is_meta
        or not (p.is_floating_point() or p.is_complex())
        for p in parameters
    ):
        return None
    device = parameters[0].device
    try:
        with GradOff():  # (on the first parameter's device, so that they stack: a model on two devices too)
            norms = [norm.float().to(device) for norm in torch._foreach_norm([p.detach() for p in parameters])]
    except (RuntimeError, NotImplementedError):  # a device or tensor subclass without the fused norm
        return None
    # (Under the user's FakeTensorMode the norms are fake: nothing to read, as every check skips them.)
    return norms if unreadable_reason(norms[0]) is None else None
