"""Which module calls need their RNG state to be replayed.

A replay (localize/replay/module_run.py) runs a module call again; a dropout inside must draw
the same mask, so the hook saves the generators' state before each call.
That costs a few microseconds per call, and most calls are of torch's own
leaf modules, which never draw random numbers: those skip it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["draws_no_random", "generator_key", "generators_of"]

#: Modules that never draw random numbers (exact types: a subclass may override
#: ``forward``). Their calls need no RNG state to be replayed, which saves its
#: capture in the hook of most calls.
_DETERMINISTIC: frozenset[type[nn.Module]] = frozenset({
    nn.Linear, nn.Bilinear, nn.Identity, nn.Flatten, nn.Unflatten, nn.Embedding, nn.EmbeddingBag,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.LPPool1d, nn.LPPool2d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle, nn.Softmax, nn.LogSoftmax, nn.Softmin,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh,
    nn.Sigmoid, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Softplus, nn.Softsign, nn.Softshrink,
    nn.Hardshrink, nn.Tanhshrink, nn.Threshold, nn.LogSigmoid, nn.GLU,
})


def draws_no_random(module: nn.Module) -> bool:
    """Whether a call of ``module`` certainly draws no random numbers (a known torch leaf module)."""
    return type(module) in _DETERMINISTIC


def generators_of(module: nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator`` objects ``module`` and its submodules hold as attributes (``self.gen``), each once.

    Asked once per module (the watch names it, a model's first top-level call): their states are kept at its calls,
    so that a replay draws what the call drew (hot/kept/generators.py).
    """
    found: dict[int, torch.Generator] = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, torch.Generator):
                found.setdefault(generator_key(value), value)
    return list(found.values())


def generator_key(generator: torch.Generator) -> int:
    """Which generator ``generator`` is: the address of torch's generator under it (a random op seen by a dispatch
    mode gets a new Python object for the same generator, hot/kept/generators.py)."""
    key: int = getattr(generator, "_cdata")  # noqa: B009 (not in torch's type stubs)
    return key
