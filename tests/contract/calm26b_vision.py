"""Vision models in the shapes of timm and torchvision, a U-Net and a diffusion step, healthy in every mode.

Built from code (neither library is installed): a ResNet trained channels_last, a ConvNeXt with LayerScale and
stochastic depth, a MobileNetV3 with depthwise convs, hardswish and squeeze-excite, a U-Net with GroupNorm (and as a
segmenter with ignore_index and Dice), mixup into a spatial transformer, and DDPM training steps (noise schedule,
sinusoidal timestep embedding, EMA weights; one in fp16 with a GradScaler). Silent, and the run bit-identical
to the unwatched one (calm26.finish: losses, state, RNG stream, what is left on the model and optimizer).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from contract import Case, Scenario
from contract.calm26 import finish, training


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: conv-BN-ReLU twice, a strided 1x1 projection on the shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(out)) + identity, inplace=True)


def _resnet() -> Scenario:
    """A ResNet in channels_last (model and images), SGD with Nesterov momentum and weight decay, label smoothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.MaxPool2d(2), BasicBlock(8, 8), BasicBlock(8, 16, 2), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 5)).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    images = torch.randn(4, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 5, (4,))
    return training(model, lambda s: F.cross_entropy(model(images), labels, label_smoothing=0.1), opt)


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: a LayerNorm over the channels of an NCHW map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                            self.eps).permute(0, 3, 1, 2)


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """timm's stochastic depth: a whole sample's branch dropped, the kept ones scaled by 1/(1-p)."""
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - p)
    return x * keep.div_(1 - p)


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, LayerNorm, an inverted MLP with GELU, LayerScale (gamma 1e-6), stochastic depth."""

    def __init__(self, dim: int, drop: float = 0.2) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_dw(x).permute(0, 2, 3, 1)
        h = self.fc2(F.gelu(self.fc1(self.norm(h)))) * self.gamma
        return x + drop_path(h.permute(0, 3, 1, 2), self.drop, self.training)


def _convnext() -> Scenario:
    """A patchify stem, two ConvNeXt blocks, a LayerNorm2d downsample; AdamW with no decay on norms and gammas."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 4, 4), LayerNorm2d(16, eps=1e-6), ConvNeXtBlock(16), ConvNeXtBlock(16),
                          LayerNorm2d(16, eps=1e-6), nn.Conv2d(16, 24, 2, 2), ConvNeXtBlock(24),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(24), nn.Linear(24, 5))
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3)
    images, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    return training(model, lambda s: F.cross_entropy(model(images), labels), opt)


class SqueezeExcite(nn.Module):
    def __init__(self, dim: int, squeezed: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(dim, squeezed, 1), nn.Conv2d(squeezed, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = F.hardsigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))
        return x * scale


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expand, depthwise 3x3, squeeze-excite, 1x1 project; hardswish; a residual."""

    def __init__(self, cin: int, expand: int, cout: int, stride: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(cin, expand, 1, bias=False), nn.BatchNorm2d(expand), nn.Hardswish(),
            nn.Conv2d(expand, expand, 3, stride, 1, groups=expand, bias=False), nn.BatchNorm2d(expand),
            nn.Hardswish(), SqueezeExcite(expand, 8),
            nn.Conv2d(expand, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.residual else out


def _mobilenet() -> Scenario:
    """MobileNetV3-small's shape with dropout before the classifier; RMSprop as its paper trained it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(),
                          InvertedResidual(16, 32, 16, 1), InvertedResidual(16, 48, 24, 2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 32), nn.Hardswish(),
                          nn.Dropout(0.2), nn.Linear(32, 5))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, eps=1e-3, weight_decay=1e-5)
    images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    return training(model, lambda s: F.cross_entropy(model(images), labels), opt)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """The sinusoidal timestep embedding of DDPM/ADM (diffusers' get_timestep_embedding)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    """GroupNorm, SiLU, conv, with the time embedding added between the convs; a 1x1 skip where widths differ."""

    def __init__(self, cin: int, cout: int, tdim: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.time = nn.Linear(tdim, cout)
        self.norm2, self.conv2 = nn.GroupNorm(4, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Identity() if cin == cout else nn.Conv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.time(F.silu(temb))[:, :, None, None]
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class UNet(nn.Module):
    """Two levels: down by a strided conv, up by nearest interpolation, the skip concatenated; a time MLP."""

    def __init__(self, ch: int = 8, tdim: int = 16) -> None:
        super().__init__()
        self.tdim = tdim
        self.time_mlp = nn.Sequential(nn.Linear(tdim, 2 * tdim), nn.SiLU(), nn.Linear(2 * tdim, tdim))
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.down = ResBlock(ch, ch, tdim)
        self.pool = nn.Conv2d(ch, ch, 3, 2, 1)
        self.mid = ResBlock(ch, 2 * ch, tdim)
        self.up = ResBlock(3 * ch, ch, tdim)
        self.out = nn.Sequential(nn.GroupNorm(4, ch), nn.SiLU(), nn.Conv2d(ch, 3, 3, padding=1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.time_mlp(timestep_embedding(t, self.tdim))
        skip = self.down(self.stem(x), temb)
        h = self.mid(self.pool(skip), temb)
        h = self.up(torch.cat([F.interpolate(h, scale_factor=2.0, mode="nearest"), skip], 1), temb)
        return self.out(h)


def _unet_segmentation() -> Scenario:
    """The U-Net as a denoiser-free regressor (t fixed at 0): an L1 loss on a target map, Adam."""
    torch.manual_seed(0)
    model = UNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, target = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
    t = torch.zeros(2, dtype=torch.long)
    return training(model, lambda s: F.l1_loss(model(x, t), target), opt)


def _diffusion() -> Scenario:
    """A DDPM step: a cosine schedule (betas clipped at 0.999), random timesteps and noise drawn in the step,
    the noised image, an epsilon-prediction MSE, gradient clipping, AdamW, and an EMA of the weights."""
    torch.manual_seed(0)
    model = UNet()
    ema = UNet()
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0)
    steps = 100
    s = torch.linspace(0, steps, steps + 1, dtype=torch.float64) / steps
    f = torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    alphas_cumprod = torch.cumprod(1 - betas, 0).float()
    images = torch.rand(2, 3, 16, 16) * 2 - 1

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            t = torch.randint(0, steps, (images.shape[0],))
            noise = torch.randn_like(images)
            a = alphas_cumprod[t].view(-1, 1, 1, 1)
            noisy = a.sqrt() * images + (1 - a).sqrt() * noise
            loss = F.mse_loss(model(noisy, t), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 1 - 0.999)
            losses.append(loss.detach())
        return finish(losses, model, ema, opt)

    return Scenario((model, opt), run)


def _segmentation() -> Scenario:
    """The U-Net as a segmenter: logits resized (antialiased bilinear), cross-entropy with ignore_index=255 (one
    image wholly ignored), plus a soft Dice over the valid pixels."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"unet": UNet(), "head": nn.Conv2d(3, 4, 1)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, t = torch.randn(2, 3, 16, 16), torch.zeros(2, dtype=torch.long)
    y = torch.randint(0, 4, (2, 16, 16))
    y[0, :4] = 255
    y[1] = 255

    def loss_of(step: int) -> torch.Tensor:
        logits = model["head"](model["unet"](x, t))
        logits = F.interpolate(logits, size=(20, 20), mode="bilinear", antialias=True, align_corners=False)
        logits = F.interpolate(logits, size=(16, 16), mode="bilinear", align_corners=False)
        valid = (y != 255).unsqueeze(1)
        probs = logits.softmax(1) * valid
        onehot = F.one_hot(y.clamp(max=3), 4).permute(0, 3, 1, 2) * valid
        dice = 1 - (2 * (probs * onehot).sum((2, 3)) + 1) / (probs.sum((2, 3)) + onehot.sum((2, 3)) + 1)
        return F.cross_entropy(logits, y, ignore_index=255) + dice.mean()

    return training(model, loss_of, opt)


def _mixup_spatial_transformer() -> Scenario:
    """Mixup (lambda from a Beta, a permuted batch, soft targets) into a spatial transformer (affine_grid,
    grid_sample with zero padding) started at the identity, then a small BN classifier."""
    torch.manual_seed(0)
    loc = nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 6))
    nn.init.zeros_(loc[-1].weight)
    with torch.no_grad():
        loc[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))
    clf = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 5))
    model = nn.ModuleDict({"loc": loc, "clf": clf})
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    beta = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4))

    def loss_of(step: int) -> torch.Tensor:
        lam, perm = beta.sample(), torch.randperm(4)
        mixed = lam * x + (1 - lam) * x[perm]
        grid = F.affine_grid(loc(mixed).view(-1, 2, 3), list(mixed.shape), align_corners=False)
        warped = F.grid_sample(mixed, grid, padding_mode="zeros", align_corners=False)
        target = lam * F.one_hot(y, 5).float() + (1 - lam) * F.one_hot(y[perm], 5).float()
        return torch.sum(-target * F.log_softmax(clf(warped), -1), -1).mean()

    return training(model, loss_of)


def _diffusion_fp16_scaler() -> Scenario:
    """The DDPM step in float16 autocast with a GradScaler whose first scale (2**19) overflows the gradients: that
    step is skipped (benign), the next ones train. Unscaled before clipping; the EMA an ``AveragedModel`` made in
    the watched cell (a deepcopy of the watched model)."""
    torch.manual_seed(0)
    model = UNet()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 19)
    alphas_cumprod = torch.linspace(0.99, 0.01, 100)
    images = torch.randn(2, 3, 16, 16)

    def run() -> tuple[Any, ...]:
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
        losses = []
        for _ in range(3):
            t = torch.randint(0, 100, (2,))
            noise = torch.randn_like(images)
            a = alphas_cumprod[t].view(-1, 1, 1, 1)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(a.sqrt() * images + (1 - a).sqrt() * noise, t), noise)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            ema.update_parameters(model)
            losses.append(loss.detach())
        return (*finish(losses, model, ema, opt), scaler.get_scale())

    return Scenario((model, opt), run)


ROWS = {
    "resnet-channels-last": _resnet,
    "convnext-layerscale-droppath": _convnext,
    "mobilenetv3-depthwise-hardswish": _mobilenet,
    "unet-groupnorm": _unet_segmentation,
    "ddpm-step-ema": _diffusion,
    "segmentation-ignore-index-dice": _segmentation,
    "mixup-spatial-transformer": _mixup_spatial_transformer,
}

CASES = [
    *(Case(f"calm26b_{name}", build, None, benign=0) for name, build in ROWS.items()),
    # The overflowing first step, skipped by the scaler: one benign event, in every mode.
    Case("calm26b_ddpm-fp16-gradscaler-skip", _diffusion_fp16_scaler, None, benign=1),
]
