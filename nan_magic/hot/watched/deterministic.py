"""Which module calls need their RNG state to be replayed.

A replay (localize/replay/module_run.py) runs a module call again; a dropout inside must draw
the same mask, so the hook saves the generators' state before each call.
That costs a few microseconds per call, and most calls are of torch's own
leaf modules, which never draw random numbers: those skip it.
"""

from __future__ import annotations

from torch import nn

__all__ = ["draws_no_random"]

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
