"""Healthy models and autograd tools under the watch (calm_s32), every mode.

Each row is a loop (tests/calm_s30.py: the harness, what is compared): per-sample gradients clipped and noised by
torch.func (vmap of grad over functional_call with buffers), a gradient-norm regulariser and an R1 penalty by
autograd.grad(create_graph=True), Meta-SGD (learned inner learning rates, second order), an EMA AveragedModel that
averages buffers too (get_ema_multi_avg_fn, use_buffers) under SWALR, a DINO teacher updated by _foreach_mul_ /
_foreach_add_ with a centring buffer, global pruning removed mid-loop and iterative structured pruning each step, a
custom parametrization with right_inverse read under parametrize.cached(), a Householder orthogonal map, a
discriminator's spectral_norm switched between eval() and train(), one embedding tied three ways, a sparse
EmbeddingBag with per-sample weights under SparseAdam, a depthwise channels_last net under bfloat16 autocast, a
float64 model with AMSGrad, a Fourier layer with complex64 weights, per-channel fake quantization whose observer is
switched off mid-loop, custom autograd Functions (mark_non_differentiable, once_differentiable,
set_materialize_grads(False), a generated vmap rule), torch.autograd.backward over two losses, nucleus sampling
with -inf filtering and scheduled sampling with -inf banned tokens in the forward.
test_calm_s32_loops.py: loop shapes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from calm_s30 import MODES, Row, check, data, mlp, sgd, steps
from torch import nn
from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver
from torch.autograd.function import once_differentiable
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F
from torch.nn.utils import parametrizations, parametrize, prune
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)

NEG_INF = float("-inf")


# -- torch.func and higher-order autograd ------------------------------------------------------------------


def per_sample_clipped_grads() -> Row:
    """DP-SGD by hand with torch.func: vmap(grad(...)) over functional_call with the parameters and a buffer, each
    sample's gradient clipped to norm 1, Gaussian noise added (the RNG moves), written into p.grad."""
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    model.register_buffer("temperature", torch.tensor(1.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()

    def sample_loss(params: dict, buffers: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (params, buffers), (xi[None],)) / buffers["temperature"]
        return F.cross_entropy(logits, yi[None])

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                params = {k: v.detach() for k, v in model.named_parameters()}
                buffers = dict(model.named_buffers())
                per = vmap(grad(sample_loss), in_dims=(None, None, 0, 0))(params, buffers, x, y)
                norms = torch.stack([g.flatten(1).norm(dim=1) for g in per.values()]).norm(dim=0)
                factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
                for name, p in model.named_parameters():
                    g = (per[name] * factor.view(-1, *[1] * (per[name].dim() - 1))).sum(0)
                    p.grad = (g + 0.01 * torch.randn_like(g)) / len(x)
                opt.step()
                with torch.no_grad():
                    out.append(F.cross_entropy(model(x), y))
        return out

    return Row((model, opt), (model, opt), run)


def gradient_norm_regulariser() -> Row:
    """loss + 0.05 * |grad_theta loss|^2: the parameters' gradients by autograd.grad(create_graph=True), then one
    backward through both."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Softplus(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = data()

    def loss_of(step: int) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        return loss + 0.05 * sum(g.pow(2).sum() for g in grads)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def r1_penalty() -> Row:
    """A discriminator's non-saturating loss plus the R1 penalty on the real images' input gradient."""
    disc = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt = torch.optim.Adam(disc.parameters(), lr=0.002, betas=(0.0, 0.99))
    real, fake = torch.randn(8, 6), torch.randn(8, 6) * 2

    def loss_of(step: int) -> torch.Tensor:
        x = real.clone().requires_grad_(True)
        real_logits = disc(x)
        (g,) = torch.autograd.grad(real_logits.sum(), x, create_graph=True)
        r1 = g.pow(2).sum(1).mean()
        return F.softplus(-real_logits).mean() + F.softplus(disc(fake)).mean() + 5.0 * r1

    return Row((disc, opt), (disc, opt), steps(disc, opt, loss_of))


def meta_sgd_second_order() -> Row:
    """Meta-SGD: a learned inner learning rate per parameter, two inner steps by autograd.grad(create_graph=True)
    through functional_call, the outer loss on the query set trains both."""
    model = mlp(4, 1)
    inner_lr = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(torch.full_like(p, 0.05))
                                 for k, p in model.named_parameters()})
    opt = torch.optim.Adam([*model.parameters(), *inner_lr.parameters()], lr=0.005)
    tasks = [(torch.randn(5, 4), torch.randn(5, 1), torch.randn(5, 4), torch.randn(5, 1)) for _ in range(2)]

    def loss_of(step: int) -> torch.Tensor:
        total = torch.zeros(())
        for xs, ys, xq, yq in tasks:
            fast = dict(model.named_parameters())
            for _ in range(2):
                inner = F.mse_loss(functional_call(model, fast, (xs,)), ys)
                grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
                fast = {k: w - inner_lr[k.replace(".", "_")] * g for (k, w), g in zip(fast.items(), grads)}
            total = total + F.mse_loss(functional_call(model, fast, (xq,)), yq)
        return total / len(tasks)

    return Row((model, inner_lr, opt), (model, inner_lr, opt), steps(model, opt, loss_of))


# -- averaged copies ---------------------------------------------------------------------------------------


def ema_averaged_model_with_buffers() -> Row:
    """AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True) over a BatchNorm net, SWALR with
    linear annealing, the average evaluated each step under no_grad."""
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    sched = SWALR(opt, swa_lr=0.02, anneal_epochs=2, anneal_strategy="linear")
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(4):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                ema.update_parameters(model)
                sched.step()
                with torch.no_grad():
                    ema.eval()
                    out += [loss.detach(), ema(x)]
        return out

    return Row((model, opt), (model, ema, opt), run)


class Dino(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.normalize(self.backbone(x), dim=-1))


def dino_teacher() -> Row:
    """DINO: the teacher (never trained, not watched) follows the student by _foreach_mul_ / _foreach_add_, its
    outputs centred by a running centre and sharpened; the student learns the cross-entropy to them."""
    student, teacher = Dino(), Dino()
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    center = torch.zeros(8)
    opt = torch.optim.AdamW(student.parameters(), lr=0.01, weight_decay=0.04)
    views = [torch.randn(8, 6) for _ in range(2)]

    def run(watching) -> list[torch.Tensor]:
        nonlocal center
        out = []
        with watching(student, opt):
            for _ in range(3):
                with torch.no_grad():
                    t_out = [teacher(v) for v in views]
                    t_probs = [((t - center) / 0.04).softmax(-1) for t in t_out]
                s_logp = [(student(v) / 0.1).log_softmax(-1) for v in views]
                loss = sum(-(t_probs[i] * s_logp[1 - i]).sum(-1).mean() for i in range(2)) / 2
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    sp, tp = list(student.parameters()), list(teacher.parameters())
                    torch._foreach_mul_(tp, 0.99)
                    torch._foreach_add_(tp, sp, alpha=0.01)
                    center = center * 0.9 + torch.cat(t_out).mean(0) * 0.1
                out.append(loss.detach())
        return [*out, center]

    return Row((student, opt), (student, teacher, opt), run)


# -- pruning and parametrizations --------------------------------------------------------------------------


def global_pruning_removed_mid_loop() -> Row:
    """prune.global_unstructured over both Linear weights (weight_orig, weight_mask, a forward pre-hook) at step 0,
    made permanent by prune.remove at step 2 while the watch is on."""
    model = mlp()
    opt = sgd(model)
    x, y = data()
    layers = [(model[0], "weight"), (model[2], "weight")]

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                if step == 0:
                    prune.global_unstructured(layers, pruning_method=prune.L1Unstructured, amount=0.3)
                if step == 2:
                    for module, name in layers:
                        prune.remove(module, name)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def iterative_structured_pruning() -> Row:
    """prune.ln_structured applied again every step (a PruningContainer grows), Adam's state on weight_orig."""
    model = mlp()
    prune.identity(model[0], "weight")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                prune.ln_structured(model[0], "weight", amount=2, n=2, dim=0)
                out += [loss.detach(), model[0].weight_mask.sum()]
        return out

    return Row((model, opt), (model, opt), run)


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(0, 1)

    def right_inverse(self, a: torch.Tensor) -> torch.Tensor:
        return a.triu()


def cached_symmetric_parametrization() -> Row:
    """A custom parametrization with right_inverse (the weight assigned back once), the forward run under
    parametrize.cached() so the weight is computed once for the two calls."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    with torch.no_grad():
        model[0].weight = torch.eye(6) * 0.5 + 0.1
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = data()

    def loss_of(step: int) -> torch.Tensor:
        with parametrize.cached():
            return F.cross_entropy(model(x), y) + 0.1 * F.cross_entropy(model(x * 0.5), y)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def householder_orthogonal_rnn() -> Row:
    """An RNN's square transition kept orthogonal by parametrizations.orthogonal(orthogonal_map="householder")."""

    class Rnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.rec, self.out = nn.Linear(4, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 2)
            parametrizations.orthogonal(self.rec, orthogonal_map="householder")

        def forward(self, xs: torch.Tensor) -> torch.Tensor:
            h = torch.zeros(xs.shape[0], 8)
            for t in range(xs.shape[1]):
                h = torch.tanh(self.inp(xs[:, t]) + self.rec(h))
            return self.out(h)

    model = Rnn()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.005)
    xs, y = torch.randn(4, 5, 4), torch.randint(0, 2, (4,))
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(model(xs), y)))


def spectral_norm_gan_eval_switch() -> Row:
    """A GAN whose discriminator has parametrizations.spectral_norm convs: D in train() for its step (the power
    iteration updates u, v), in eval() while the generator steps (no update), two optimizers."""
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Unflatten(1, (2, 4, 4)))
    disc = nn.Sequential(parametrizations.spectral_norm(nn.Conv2d(2, 4, 3, padding=1)), nn.LeakyReLU(0.2),
                         nn.Flatten(), parametrizations.spectral_norm(nn.Linear(64, 1)))
    opt_g = torch.optim.Adam(gen.parameters(), lr=0.002, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.002, betas=(0.5, 0.9))
    real = torch.randn(4, 2, 4, 4)

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                z = torch.randn(4, 4)
                disc.train()
                d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(gen(z).detach())).mean()
                opt_d.zero_grad()
                d_loss.backward()
                opt_d.step()
                disc.eval()
                g_loss = F.softplus(-disc(gen(z))).mean()
                opt_g.zero_grad()
                g_loss.backward()
                opt_g.step()
                out += [d_loss.detach(), g_loss.detach()]
        disc.train()
        return out

    return Row((gen, disc, opt_g, opt_d), (gen, disc, opt_g, opt_d), run)


# -- embeddings, layouts, dtypes ---------------------------------------------------------------------------


class TiedSeq2Seq(nn.Module):
    """One embedding is the encoder's input, the decoder's input and (transposed) the output projection."""

    def __init__(self, vocab: int = 12, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.enc = nn.GRU(d, d, batch_first=True)
        self.dec = nn.GRU(d, d, batch_first=True)
        self.proj = nn.Linear(d, vocab, bias=False)
        self.proj.weight = self.emb.weight

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        _, h = self.enc(self.emb(src))
        out, _ = self.dec(self.emb(tgt_in), h)
        return self.proj(out)


def three_way_tied_embedding() -> Row:
    model = TiedSeq2Seq()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    src, tgt = torch.randint(1, 12, (3, 5)), torch.randint(1, 12, (3, 6))
    tgt[2, 4:] = 0

    def loss_of(step: int) -> torch.Tensor:
        logits = model(src, tgt[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=0, label_smoothing=0.1)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


class BagRecommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 8, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bag(ids, offsets, per_sample_weights=weights)).squeeze(-1)


def sparse_embedding_bag() -> Row:
    """An EmbeddingBag(sparse=True, mode="sum") with offsets and per-sample weights under SparseAdam, the dense
    layers under Adam."""
    model = BagRecommender()
    sparse_opt = torch.optim.SparseAdam(list(model.bag.parameters()), lr=0.01)
    dense_opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    ids, offsets = torch.randint(0, 30, (14,)), torch.tensor([0, 3, 7, 7, 10])
    weights, y = torch.rand(14), torch.rand(5)

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.binary_cross_entropy_with_logits(model(ids, offsets, weights), y)
                sparse_opt.zero_grad()
                dense_opt.zero_grad()
                loss.backward()
                sparse_opt.step()
                dense_opt.step()
                out.append(loss.detach())
        return out

    return Row((model, sparse_opt, dense_opt), (model, sparse_opt, dense_opt), run)


def depthwise_channels_last_bf16() -> Row:
    """A MobileNet-like block (depthwise conv, GroupNorm, pointwise conv, SiLU) in channels_last under bfloat16
    autocast on CPU."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 8, 1), nn.SiLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    model = model.to(memory_format=torch.channels_last)
    opt = sgd(model)
    x, y = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last), torch.randint(0, 3, (4,))

    def loss_of(step: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        return F.cross_entropy(logits.float(), y)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def float64_amsgrad() -> Row:
    """A double-precision regression (a float64 buffer too) under Adam(amsgrad=True)."""
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    model.register_buffer("scale", torch.tensor([2.5], dtype=torch.float64))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True)
    x = torch.randn(16, 4, dtype=torch.float64)
    y = x.sum(1, keepdim=True).sin() * model.scale
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.mse_loss(model(x), y), 4))


class SpectralConv(nn.Module):
    """A Fourier layer: rfft, a complex64 weight on the lowest modes, irfft."""

    def __init__(self, ch: int = 4, modes: int = 5) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(ch, ch, modes, dtype=torch.complex64) / ch)
        self.skip = nn.Conv1d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = torch.fft.rfft(x)
        out = torch.zeros_like(xf)
        out[..., :self.modes] = torch.einsum("bix,iox->box", xf[..., :self.modes], self.weight)
        return F.gelu(torch.fft.irfft(out, n=x.shape[-1]) + self.skip(x))


def fourier_layer_complex64() -> Row:
    model = nn.Sequential(nn.Conv1d(1, 4, 1), SpectralConv(), SpectralConv(), nn.Conv1d(4, 1, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.005)
    x = torch.randn(3, 1, 16)
    y = torch.roll(x, 2, -1)
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.mse_loss(model(x), y)))


class FakeQuantNet(nn.Module):
    """Fake-quantized weights (per channel, symmetric int8) and activations (per tensor, quint8)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)
        self.wq = FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                               dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)
        self.aq = FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.aq(F.relu(F.linear(x, self.wq(self.fc1.weight), self.fc1.bias)))
        return self.fc2(h)


def per_channel_fake_quant() -> Row:
    """Quantization-aware training: the observers are switched off after step 1 (disable_observer), fake
    quantization stays on."""
    model = FakeQuantNet()
    opt = sgd(model)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                if step == 2:
                    model.apply(torch.ao.quantization.disable_observer)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


# -- custom autograd Functions -----------------------------------------------------------------------------


class MaxWithIndex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, index = x.max(-1)
        ctx.save_for_backward(index)
        ctx.shape = x.shape
        ctx.mark_non_differentiable(index)
        return values, index

    @staticmethod
    def backward(ctx, grad_values: torch.Tensor, grad_index: None) -> torch.Tensor:
        (index,) = ctx.saved_tensors
        return torch.zeros(ctx.shape).scatter(-1, index[..., None], grad_values[..., None])


class SignSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.sign()

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 1).to(g.dtype)


class SplitHalves(torch.autograd.Function):
    """Two outputs, the second often unused: with set_materialize_grads(False) its gradient arrives as None."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        a, b = x.chunk(2, -1)
        return a * 2, b * 3

    @staticmethod
    def backward(ctx, ga: torch.Tensor | None, gb: torch.Tensor | None) -> torch.Tensor:
        ga = torch.zeros_like(gb) if ga is None else ga * 2
        gb = torch.zeros_like(ga) if gb is None else gb * 3
        return torch.cat([ga, gb], -1)


class ScaledTanh(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.tanh(x) * scale

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(output)
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (out,) = ctx.saved_tensors
        return g * (ctx.scale - out * out / ctx.scale), None


class CustomFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 16), nn.Linear(8, 12), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = SplitHalves.apply(self.fc1(x))
        h = SignSTE.apply(self.fc2(a + b if use_b else a))
        values, index = MaxWithIndex.apply(h.view(-1, 3, 4))
        return self.fc3(ScaledTanh.apply(values.view(-1, 3) @ torch.ones(3, 4), 1.5)), index


def custom_functions() -> Row:
    """mark_non_differentiable (an index output), once_differentiable (a straight-through sign),
    set_materialize_grads(False) (an unused output's None gradient), setup_context with a generated vmap rule."""
    model = CustomFunctions()
    opt = sgd(model)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                logits, index = model(x, use_b=step % 2 == 1)
                loss = F.cross_entropy(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out += [loss.detach(), index]
            per = vmap(grad(lambda v: ScaledTanh.apply(v, 2.0).sum()))(x)
        return [*out, per]

    return Row((model, opt), (model, opt), run)


def two_losses_by_autograd_backward() -> Row:
    """torch.autograd.backward([task_loss, aux_loss], [1, 0.3]) instead of loss.backward()."""
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = sgd(model)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                logits = model(x)
                task = F.cross_entropy(logits[:, :3], y)
                aux = logits[:, 3].pow(2).mean()
                opt.zero_grad()
                torch.autograd.backward([task, aux], [torch.tensor(1.0), torch.tensor(0.3)])
                opt.step()
                out += [task.detach(), aux.detach()]
        return out

    return Row((model, opt), (model, opt), run)


# -- decoding with -inf scores -----------------------------------------------------------------------------


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 10, d: int = 8) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(vocab, d), nn.GRU(d, d, batch_first=True), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(ids))[0])


def nucleus_sampling_between_steps() -> Row:
    """After each training step, a sample of five tokens by top-k then top-p filtering (logits set to -inf,
    softmax, multinomial) inside the watch."""
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ids = torch.randint(0, 10, (4, 6))

    def sample(prompt: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            logits = model(prompt)[:, -1] / 0.8
            kth = logits.topk(5).values[:, -1:]
            logits = logits.masked_fill(logits < kth, NEG_INF)
            sorted_logits, order = logits.sort(-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = (cum - sorted_logits.softmax(-1)) > 0.9
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, NEG_INF))
            prompt = torch.cat([prompt, torch.multinomial(logits.softmax(-1), 1)], 1)
        return prompt

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    out.append(sample(ids[:2, :2]))
                model.train()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


class ScheduledSampler(nn.Module):
    """Scheduled sampling: the decoder's next input is its own greedy choice, tokens already emitted banned by
    -inf (no repeats), the top two kept by topk."""

    def __init__(self, vocab: int = 10, d: int = 8) -> None:
        super().__init__()
        self.emb, self.cell, self.head = nn.Embedding(vocab, d), nn.GRUCell(d, d), nn.Linear(d, vocab)

    def forward(self, start: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.zeros(start.shape[0], self.cell.hidden_size)
        token, banned = start, torch.zeros(start.shape[0], self.head.out_features, dtype=torch.bool)
        all_logits, chosen = [], []
        for _ in range(length):
            h = self.cell(self.emb(token), h)
            logits = self.head(h)
            all_logits.append(logits)
            banned = banned.scatter(1, token[:, None], True)
            top = logits.detach().masked_fill(banned, NEG_INF).topk(2, -1)
            token = top.indices[:, 0]
            chosen.append(top.values)
        return torch.stack(all_logits, 1), torch.stack(chosen, 1)


def scheduled_sampling_with_banned_tokens() -> Row:
    model = ScheduledSampler()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    start, targets = torch.randint(0, 10, (3,)), torch.randint(0, 10, (3, 4))

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                logits, chosen = model(start, 4)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                out += [loss.detach(), chosen]
        return out

    return Row((model, opt), (model, opt), run)


ROWS = {
    "per_sample_clipped_grads": per_sample_clipped_grads,
    "gradient_norm_regulariser": gradient_norm_regulariser,
    "r1_penalty": r1_penalty,
    "meta_sgd_second_order": meta_sgd_second_order,
    "ema_averaged_model_with_buffers": ema_averaged_model_with_buffers,
    "dino_teacher": dino_teacher,
    "global_pruning_removed_mid_loop": global_pruning_removed_mid_loop,
    "iterative_structured_pruning": iterative_structured_pruning,
    "cached_symmetric_parametrization": cached_symmetric_parametrization,
    "householder_orthogonal_rnn": householder_orthogonal_rnn,
    "spectral_norm_gan_eval_switch": spectral_norm_gan_eval_switch,
    "three_way_tied_embedding": three_way_tied_embedding,
    "sparse_embedding_bag": sparse_embedding_bag,
    "depthwise_channels_last_bf16": depthwise_channels_last_bf16,
    "float64_amsgrad": float64_amsgrad,
    "fourier_layer_complex64": fourier_layer_complex64,
    "per_channel_fake_quant": per_channel_fake_quant,
    "custom_functions": custom_functions,
    "two_losses_by_autograd_backward": two_losses_by_autograd_backward,
    "nucleus_sampling_between_steps": nucleus_sampling_between_steps,
    "scheduled_sampling_with_banned_tokens": scheduled_sampling_with_banned_tokens,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_models_and_tools_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)


def test_the_rows_really_meet_what_they_handle() -> None:
    """The decoding rows really write -inf; the Functions' unused output really gets a None gradient; the pruning
    row really leaves weight_orig and comes back to a plain weight."""
    torch.manual_seed(0)
    model = ScheduledSampler()
    h = torch.zeros(3, 8)
    logits = model.head(model.cell(model.emb(torch.tensor([1, 2, 3])), h))
    assert torch.isinf(logits.masked_fill(torch.eye(3, 10, dtype=torch.bool), NEG_INF)).sum() == 3
    seen = []

    class Probe(SplitHalves):
        @staticmethod
        def backward(ctx, ga, gb):  # type: ignore[override]
            seen.append((ga is None, gb is None))
            return SplitHalves.backward(ctx, ga, gb)

    a, _ = Probe.apply(torch.randn(2, 4, requires_grad=True))
    a.sum().backward()
    assert seen == [(False, True)]
    row = global_pruning_removed_mid_loop()
    row.run(contextlib.nullcontext)
    model = row.held[0]
    assert sorted(n for n, _ in model.named_parameters()) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert not model[0]._forward_pre_hooks and not dict(model[0].named_buffers())
