"""Healthy training the watch must stay silent on, bit-identical to an unwatched run (calm_s34), every mode.

Each row is a loop (tests/calm_s30.py: the harness, what is compared: outputs, parameters, gradients, buffers,
optimizer state, RNG, hooks and attributes left, weak references, what stays alive). Values that are legitimately
infinite or NaN and handled: an fp16 finfo.min mask softmaxed in float32, a graph-attention softmax whose segment
max starts at -inf (scatter_reduce amax), an amin scatter whose unreached rows keep their +inf init and are put
back by where(), clamp with +-inf tensor bounds (no bound), log_softmax over -inf unavailable classes with nll_loss,
NaN labels left out by a boolean index, a nearest-neighbour distance with the diagonal masked by +inf, a
hand-written stable logsumexp whose fully masked rows are guarded, KL divergence against a target with exact zeros.
Distributions: a mixture density network's NLL, a tanh-squashed Gaussian (SAC) policy's log-prob. Layers rarely
run: PixelShuffle and ConvTranspose2d with Mish, MaxUnpool2d from MaxPool2d's indices, Unfold/Fold patches with
LocalResponseNorm, RReLU (random in training) with CELU/Softsign/Tanhshrink/Threshold, ChannelShuffle with
InstanceNorm2d(track_running_stats) and Softmax2d, an LSTM that calls flatten_parameters at each forward,
EmbeddingBag with per_sample_weights, AdaptiveLogSoftmaxWithLoss, a complex spectral filter (view_as_complex
parameters, rfft/irfft), a ridge head solved in closed form by linalg.solve. Losses: CosineEmbedding,
MarginRanking, Huber, MultiMargin, MultiLabelSoftMargin, PoissonNLL(log_input=False), GaussianNLL(full=True).
What users change mid-run: set_submodule swapping an activation, a parameter registered and a layer added mid-run
(add_param_group), a custom parametrization registered after the watch starts, a Linear+BatchNorm1d fused for
evaluation (fuse_linear_bn_eval), the user's state_dict / load_state_dict hooks with a round trip mid-run, the
model moved to float64 mid-run. Optimizers: step pre/post hooks projecting the weights, Rprop and ASGD on disjoint
groups, clip_grads_with_norm_ with get_total_norm, a CPU GradScaler that is enabled, CyclicLR with momentum cycling.
test_calm_s34_loops.py: what leaves the watch (pickles, scripting, exceptions).
"""

from __future__ import annotations

import pytest
import torch
from calm_s30 import MODES, Row, check, data, mlp, sgd, steps
from torch import nn
from torch.distributions import Categorical, MixtureSameFamily, Normal, TransformedDistribution
from torch.distributions.transforms import TanhTransform
from torch.nn import functional as F
from torch.nn.utils import fusion, parametrize

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)

INF = float("inf")


def _plain(model: nn.Module, loss_of, opt: torch.optim.Optimizer | None = None, n: int = 3) -> Row:
    opt = opt or torch.optim.Adam(model.parameters(), lr=0.01)
    return Row((model, opt), (model, opt), steps(model, opt, loss_of, n))


# -- values that are legitimately infinite or NaN, handled ----------------------------------------------------


class HalfMaskAttention(nn.Module):
    """Scores in float16 masked by finfo(float16).min, softmaxed in float32 (a mixed-precision habit on CPU)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qk, self.head = nn.Linear(d, 2 * d), nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        scores = (q @ k.transpose(-1, -2)).half().masked_fill(~valid[:, None, :], torch.finfo(torch.float16).min)
        return self.head((scores.float().softmax(-1) @ x).mean(1))


def _tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    return torch.randn(4, 5, 8), valid, torch.randint(0, 3, (4,))


def half_finfo_min_mask() -> Row:
    model = HalfMaskAttention()
    x, valid, y = _tokens()
    return _plain(model, lambda s: F.cross_entropy(model(x, valid), y))


class GraphAttention(nn.Module):
    """Edge softmax per destination: the segment max starts at -inf (nodes with no incoming edge keep it, never
    gathered), exp of score minus max, sums by index_add."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin, self.att, self.head = nn.Linear(d, 8), nn.Linear(16, 1), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        score = F.leaky_relu(self.att(torch.cat([h[src], h[dst]], -1)).squeeze(-1), 0.2)
        top = torch.full((x.shape[0],), -INF).scatter_reduce(0, dst, score, "amax", include_self=True)
        e = torch.exp(score - top[dst])
        alpha = e / torch.zeros(x.shape[0]).index_add(0, dst, e)[dst]
        out = torch.zeros_like(h).index_add(0, dst, alpha[:, None] * h[src])
        return self.head(out)


def graph_attention_neg_inf_segment_max() -> Row:
    model = GraphAttention()
    x, y = data(8, 6)
    src, dst = torch.tensor([0, 1, 2, 3, 4, 5, 1, 2]), torch.tensor([1, 2, 3, 1, 2, 3, 0, 0])  # nodes 4..7: none in
    return _plain(model, lambda s: F.cross_entropy(model(x, src, dst), y))


class NearestPrototype(nn.Module):
    """Each class's closest member: amin scatter from a +inf init; a class with no member keeps +inf, put to 0 by
    where() before the loss sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        d = self.net(x).pow(2).sum(-1)
        best = torch.full((5,), INF).scatter_reduce(0, y, d, "amin", include_self=True)
        return torch.where(torch.isinf(best), torch.zeros(()), best)


def amin_scatter_inf_init_put_back_by_where() -> Row:
    model = NearestPrototype()
    x, y = torch.randn(8, 6), torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])  # classes 3 and 4 are empty
    return _plain(model, lambda s: model(x, y).sum())


class Bounded(nn.Module):
    """clamp with tensor bounds that hold +-inf where a feature has no bound."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(6, 4)
        self.register_buffer("lo", torch.tensor([-1.0, -INF, 0.0, -INF]))
        self.register_buffer("hi", torch.tensor([1.0, INF, INF, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(self.net(x), self.lo, self.hi)


def clamp_with_infinite_bounds() -> Row:
    model = Bounded()
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    return _plain(model, lambda s: F.mse_loss(model(x), y))


def log_softmax_over_unavailable_classes() -> Row:
    """Logits of the classes a sample may not take set to -inf, log_softmax, nll_loss of an available target."""
    model = mlp(6, 5)
    x = torch.randn(8, 6)
    avail = torch.rand(8, 5) > 0.4
    avail[:, 0] = True
    y = torch.multinomial(avail.float(), 1).squeeze(1)
    return _plain(model, lambda s: F.nll_loss(model(x).masked_fill(~avail, -INF).log_softmax(-1), y))


def nan_labels_left_out_by_index() -> Row:
    """Regression labels with NaN for 'not measured', the loss over the measured ones picked by a boolean index."""
    model = mlp(6, 3)
    x, t = torch.randn(8, 6), torch.randn(8, 3)
    t[torch.rand(8, 3) > 0.6] = float("nan")
    seen = ~torch.isnan(t)
    return _plain(model, lambda s: F.mse_loss(model(x)[seen], t[seen]))


def nearest_neighbour_diagonal_inf() -> Row:
    """A uniformity term: each embedding's distance to its nearest other, the diagonal masked by +inf."""
    model = mlp(6, 4)
    x, y = data()
    eye = torch.eye(8, dtype=torch.bool)

    def loss_of(step: int) -> torch.Tensor:
        z = model(x)
        nearest = torch.cdist(z, z).masked_fill(eye, INF).min(1).values
        return F.cross_entropy(z[:, :3], y) - 0.1 * torch.log(nearest + 1e-3).mean()

    return _plain(model, loss_of)


class MaskedLogSumExp(nn.Module):
    """Stable logsumexp by hand over a -inf mask: a row fully masked has max -inf, guarded to 0 by isfinite."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(6, 5)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        z = self.net(x).masked_fill(~keep, -INF)
        top = z.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros(()))
        lse = top.squeeze(-1) + torch.log(torch.exp(z - top).sum(-1).clamp_min(1e-30))
        return torch.where(keep.any(-1), lse, torch.zeros(()))


def hand_logsumexp_guarded_rows() -> Row:
    model = MaskedLogSumExp()
    x, keep = torch.randn(8, 6), torch.rand(8, 5) > 0.5
    keep[2] = False
    return _plain(model, lambda s: model(x, keep).pow(2).mean())


def kl_div_target_with_zeros() -> Row:
    """Distillation to a sparse target distribution (exact zeros): KLDivLoss's 0 * log 0 is 0."""
    model = mlp(6, 5)
    x = torch.randn(8, 6)
    target = torch.softmax(torch.randn(8, 5), -1) * (torch.rand(8, 5) > 0.5)
    target[:, 0] += 0.1
    target = target / target.sum(-1, keepdim=True)
    loss = nn.KLDivLoss(reduction="batchmean")
    return _plain(model, lambda s: loss(model(x).log_softmax(-1), target))


# -- distributions -----------------------------------------------------------------------------------------------


def mixture_density_nll() -> Row:
    model = mlp(6, 9)
    x, t = torch.randn(8, 6), torch.randn(8)

    def loss_of(step: int) -> torch.Tensor:
        logits, mu, raw = model(x).chunk(3, -1)
        mix = MixtureSameFamily(Categorical(logits=logits), Normal(mu, F.softplus(raw) + 1e-3))
        return -mix.log_prob(t).mean()

    return _plain(model, loss_of)


def tanh_gaussian_policy() -> Row:
    """SAC's actor: rsample from a tanh-squashed Gaussian, its log-prob through the cached transform."""
    model = mlp(6, 4)
    q = nn.Linear(8, 1)
    x = torch.randn(8, 6)
    opt = torch.optim.Adam(model.parameters(), lr=0.003)

    def loss_of(step: int) -> torch.Tensor:
        mu, log_std = model(x).chunk(2, -1)
        pi = TransformedDistribution(Normal(mu, log_std.clamp(-5, 2).exp()), [TanhTransform(cache_size=1)])
        action = pi.rsample()
        return (0.2 * pi.log_prob(action).sum(-1) - q(torch.cat([x[:, :6], action], -1)).squeeze(-1)).mean()

    return Row((model, opt), (model, q, opt), steps(model, opt, loss_of))


# -- layers rarely run -------------------------------------------------------------------------------------------


def pixel_shuffle_transpose_mish() -> Row:
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Mish(), nn.Conv2d(8, 4, 3, padding=1),
                          nn.PixelShuffle(2), nn.ConvTranspose2d(1, 1, 3, padding=1))
    x, y = torch.randn(2, 1, 4, 4), torch.randn(2, 1, 8, 8)
    return _plain(model, lambda s: F.l1_loss(model(x), y))


class UnpoolAutoencoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.pool = nn.Conv2d(1, 4, 3, padding=1), nn.MaxPool2d(2, return_indices=True)
        self.unpool, self.dec = nn.MaxUnpool2d(2), nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, idx = self.pool(torch.relu(self.enc(x)))
        return self.dec(self.unpool(h, idx, output_size=x.shape[-2:]))


def max_unpool_autoencoder() -> Row:
    model = UnpoolAutoencoder()
    x = torch.randn(2, 1, 6, 6)
    return _plain(model, lambda s: F.mse_loss(model(x), x))


class Patches(nn.Module):
    """im2col by Unfold, a Linear per patch, back by Fold (overlaps summed), LocalResponseNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.unfold, self.fold = nn.Unfold(3, padding=1), nn.Fold((6, 6), 3, padding=1)
        self.proj, self.norm = nn.Linear(18, 18), nn.LocalResponseNorm(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cols = self.unfold(x)
        return self.norm(self.fold(self.proj(cols.transpose(1, 2)).transpose(1, 2)))


def unfold_fold_local_response_norm() -> Row:
    model = Patches()
    x = torch.randn(2, 2, 6, 6)
    return _plain(model, lambda s: F.mse_loss(model(x), x))


def random_and_odd_activations() -> Row:
    """RReLU draws its slopes in training (the RNG must advance the same), CELU, Softsign, Tanhshrink, Threshold."""
    model = nn.Sequential(nn.Linear(6, 16), nn.RReLU(), nn.Linear(16, 16), nn.CELU(0.5), nn.Softsign(),
                          nn.Linear(16, 16), nn.Tanhshrink(), nn.Threshold(0.01, -0.01), nn.Linear(16, 3))
    x, y = data()
    return _plain(model, lambda s: F.cross_entropy(model(x), y))


def channel_shuffle_instance_norm() -> Row:
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
                          nn.ChannelShuffle(2), nn.Softmax2d(), nn.Conv2d(4, 1, 1))
    x, y = torch.randn(3, 2, 5, 5), torch.randn(3, 1, 5, 5)
    return _plain(model, lambda s: F.mse_loss(model(x), y))


class FlatLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(6, 8, num_layers=2), nn.Sequential(nn.Hardshrink(0.1), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lstm.flatten_parameters()
        out, _ = self.lstm(x)
        return self.head(out[-1])


def lstm_flatten_parameters_each_forward() -> Row:
    model = FlatLSTM()
    x, y = torch.randn(5, 8, 6), torch.randint(0, 3, (8,))
    return _plain(model, lambda s: F.cross_entropy(model(x), y))


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(20, 8, mode="sum", padding_idx=0), nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(tokens, offsets, per_sample_weights=weights))


def embedding_bag_per_sample_weights() -> Row:
    model = Bag()
    tokens = torch.tensor([3, 0, 5, 7, 7, 0, 1, 2, 9, 19])
    offsets, weights, y = torch.tensor([0, 3, 5, 5]), torch.rand(10), torch.randint(0, 3, (4,))  # bag 2 is empty
    return _plain(model, lambda s: F.cross_entropy(model(tokens, offsets, weights), y))


class AdaptiveHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.head = nn.AdaptiveLogSoftmaxWithLoss(16, 30, cutoffs=[4, 12], div_value=2.0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)), y).loss


def adaptive_log_softmax() -> Row:
    model = AdaptiveHead()
    x, y = torch.randn(8, 6), torch.tensor([0, 3, 5, 11, 12, 29, 20, 1])
    return _plain(model, lambda s: model(x, y))


class SpectralFilter(nn.Module):
    """A Fourier layer: rfft, a complex weight per kept mode (stored as a real pair, viewed as complex), irfft."""

    def __init__(self, modes: int = 4, n: int = 16) -> None:
        super().__init__()
        self.n, self.modes = n, modes
        self.weight = nn.Parameter(torch.randn(modes, 2) * 0.5)
        self.lin = nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = torch.fft.rfft(x)
        kept = spec[..., : self.modes] * torch.view_as_complex(self.weight)
        out = torch.fft.irfft(F.pad(kept, (0, spec.shape[-1] - self.modes)), n=self.n)
        return self.lin(F.gelu(out)) + x


def complex_spectral_filter() -> Row:
    model = SpectralFilter()
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    return _plain(model, lambda s: F.mse_loss(model(x), y))


class RidgeHead(nn.Module):
    """Features learned, the head solved in closed form per batch (a differentiable ridge regression)."""

    def __init__(self) -> None:
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.log_lam = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        f = self.feat(x)
        w = torch.linalg.solve(f.T @ f + self.log_lam.exp() * torch.eye(8), f.T @ t)
        return f @ w


def ridge_head_linalg_solve() -> Row:
    model = RidgeHead()
    x, t = torch.randn(12, 6), torch.randn(12, 2)
    return _plain(model, lambda s: F.mse_loss(model(x, t), t))


# -- losses ------------------------------------------------------------------------------------------------------


def pair_losses() -> Row:
    """CosineEmbeddingLoss and MarginRankingLoss on pairs, HuberLoss on a regression head."""
    model = mlp(6, 5)
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    same = torch.tensor([1, -1, 1, 1, -1, -1, 1, -1])
    cos, rank, huber = nn.CosineEmbeddingLoss(0.2), nn.MarginRankingLoss(0.5), nn.HuberLoss(delta=0.3)
    target = torch.randn(8)

    def loss_of(step: int) -> torch.Tensor:
        za, zb = model(a), model(b)
        return cos(za[:, :4], zb[:, :4], same) + rank(za[:, 4], zb[:, 4], same) + huber(za[:, 0], target)

    return _plain(model, loss_of)


def margin_losses() -> Row:
    model = mlp(6, 4)
    x, y = data(8, 6, 4)
    multi = (torch.rand(8, 4) > 0.5).float()
    return _plain(model, lambda s: F.multi_margin_loss(model(x), y, p=2, margin=0.5)
                  + F.multilabel_soft_margin_loss(model(x), multi))


def count_and_variance_losses() -> Row:
    """PoissonNLL on rates (log_input=False: log(rate + eps), zero counts), GaussianNLL(full=True) on a variance
    head."""
    model = mlp(6, 3)
    x, counts, t = torch.randn(8, 6), torch.poisson(torch.full((8,), 2.0)), torch.randn(8)

    def loss_of(step: int) -> torch.Tensor:
        out = model(x)
        return (F.poisson_nll_loss(F.softplus(out[:, 0]), counts, log_input=False)
                + F.gaussian_nll_loss(out[:, 1], t, F.softplus(out[:, 2]), full=True))

    return _plain(model, loss_of)


# -- what users change mid-run -----------------------------------------------------------------------------------


def _mid_run(model: nn.Module, opt: torch.optim.Optimizer, loss_of, change, at: int = 1, n: int = 4):
    def run(watching) -> list[torch.Tensor]:
        losses = []
        with watching():
            for step in range(n):
                if step == at:
                    change()
                loss = loss_of(step)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses

    return run


def set_submodule_swaps_activation() -> Row:
    model = mlp()
    opt = sgd(model)
    x, y = data()
    run = _mid_run(model, opt, lambda s: F.cross_entropy(model(x), y), lambda: model.set_submodule("1", nn.GELU()))
    return Row((model, opt), (model, opt), run)


class Growing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if hasattr(self, "bias_late"):
            out = out + self.bias_late
        if hasattr(self, "extra"):
            out = out + self.extra(out)
        return out


def parameter_and_layer_added_mid_run() -> Row:
    """A parameter registered at step 1 and a residual layer added at step 2, each given to the optimizer."""
    model = Growing()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = data()

    def grow_param() -> None:
        model.register_parameter("bias_late", nn.Parameter(torch.zeros(3)))
        opt.add_param_group({"params": [model.bias_late]})

    def grow_layer() -> None:
        model.add_module("extra", nn.Linear(3, 3))
        opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.005})

    def run(watching) -> list[torch.Tensor]:
        losses = []
        with watching():
            for step in range(4):
                if step == 1:
                    grow_param()
                if step == 2:
                    grow_layer()
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses

    return Row((model, opt), (model, opt), run)


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).T


def parametrization_registered_mid_run() -> Row:
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = sgd(model)
    x, y = data()
    run = _mid_run(model, opt, lambda s: F.cross_entropy(model(x), y),
                   lambda: parametrize.register_parametrization(model[0], "weight", Symmetric()))
    return Row((model, opt), (model, opt), run)


class LinBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.lin(x))))


def fuse_linear_bn_for_evaluation() -> Row:
    """Trained under the watch, then the Linear and BatchNorm fused for evaluation, still watched."""
    model = LinBn()
    opt = sgd(model)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            out += steps(model, opt, lambda s: F.cross_entropy(model(x), y))(lambda: _null())
            model.eval()
            before = model(x).detach()
            model.lin = fusion.fuse_linear_bn_eval(model.lin, model.bn)
            model.bn = nn.Identity()
            with torch.no_grad():
                out += [before, model(x)]
        return out

    return Row((model, opt), (model, opt), run)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def state_dict_hooks_round_trip() -> Row:
    """The user's state_dict pre-hook and load_state_dict post-hook; a snapshot taken at step 1, loaded back at 3;
    the keys must be the model's own."""
    model = mlp()
    opt = sgd(model)
    x, y = data()
    seen: list[int] = []
    model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: seen.append(1))
    model.register_load_state_dict_post_hook(lambda module, keys: seen.append(len(keys.missing_keys)))
    snap: dict = {}

    def run(watching) -> list:
        losses = []
        with watching():
            for step in range(4):
                if step == 1:
                    snap.update({k: v.clone() for k, v in model.state_dict().items()})
                    assert list(snap) == ["0.weight", "0.bias", "2.weight", "2.bias"]
                if step == 3:
                    model.load_state_dict(snap)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return [losses, seen]

    return Row((model, opt), (model, opt), run)


def model_to_float64_mid_run() -> Row:
    """model.double() at step 1 (parameters converted in place), the data converted with it."""
    model = mlp()
    opt = sgd(model)
    x, y = data()
    xs = {"x": x}

    def change() -> None:
        model.double()
        xs["x"] = x.double()

    run = _mid_run(model, opt, lambda s: F.cross_entropy(model(xs["x"]), y), change)
    return Row((model, opt), (model, opt), run)


# -- optimizers --------------------------------------------------------------------------------------------------


def optimizer_step_hooks_project_weights() -> Row:
    """A step pre-hook that clips the gradients and a post-hook that renormalizes the first layer's rows."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = data()
    opt.register_step_pre_hook(lambda o, args, kwargs: torch.nn.utils.clip_grad_value_(model.parameters(), 0.1))

    def project(o, args, kwargs) -> None:
        with torch.no_grad():
            model[0].weight /= model[0].weight.norm(dim=1, keepdim=True).clamp_min(1.0)

    opt.register_step_post_hook(project)
    return _plain(model, lambda s: F.cross_entropy(model(x), y), opt)


class _Both(torch.optim.Optimizer):
    """Two optimizers over disjoint groups stepped as one (the user's own combinator)."""

    def __init__(self, *opts: torch.optim.Optimizer) -> None:
        self.opts = opts
        self.param_groups = [g for o in opts for g in o.param_groups]
        self.defaults, self.state = {}, {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none)

    def step(self, closure=None) -> None:
        for o in self.opts:
            o.step()


def rprop_and_asgd_on_disjoint_groups() -> Row:
    model = mlp()
    x, y = data()
    first, second = torch.optim.Rprop(model[0].parameters()), torch.optim.ASGD(model[2].parameters(), lr=0.05)
    both = _Both(first, second)
    return Row((model, first, second), (model, first, second),
               steps(model, both, lambda s: F.cross_entropy(model(x), y), 4))


def clip_grads_with_total_norm() -> Row:
    """torch 2.6's split clipping: get_total_norm of the gradients, then clip_grads_with_norm_."""
    model = mlp()
    opt = sgd(model)
    x, y = 5 * torch.randn(8, 6), torch.randint(0, 3, (8,))

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                grads = [p.grad for p in model.parameters()]
                norm = torch.nn.utils.get_total_norm(grads, 2.0)
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.5, norm)
                opt.step()
                out += [loss.detach(), norm]
        return out

    return Row((model, opt), (model, opt), run)


def cpu_grad_scaler_enabled() -> Row:
    """torch.amp.GradScaler('cpu') enabled, under bfloat16 autocast: scale, unscale_, clip, step, update."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                out += [loss.detach().float(), torch.tensor(scaler.get_scale())]
        return out

    return Row((model, opt), (model, opt), run)


def cyclic_lr_momentum_cycling() -> Row:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.CyclicLR(opt, 0.001, 0.05, step_size_up=2, mode="exp_range", gamma=0.9)
    x, y = data()

    def loss_of(step: int) -> torch.Tensor:
        if step:
            sched.step()
        return F.cross_entropy(model(x), y)

    return _plain(model, loss_of, opt, 5)


ROWS = {f.__name__: f for f in (
    half_finfo_min_mask, graph_attention_neg_inf_segment_max, amin_scatter_inf_init_put_back_by_where,
    clamp_with_infinite_bounds, log_softmax_over_unavailable_classes, nan_labels_left_out_by_index,
    nearest_neighbour_diagonal_inf, hand_logsumexp_guarded_rows, kl_div_target_with_zeros, mixture_density_nll,
    tanh_gaussian_policy, pixel_shuffle_transpose_mish, max_unpool_autoencoder, unfold_fold_local_response_norm,
    random_and_odd_activations, channel_shuffle_instance_norm, lstm_flatten_parameters_each_forward,
    embedding_bag_per_sample_weights, adaptive_log_softmax, complex_spectral_filter, ridge_head_linalg_solve,
    pair_losses, margin_losses, count_and_variance_losses, set_submodule_swaps_activation,
    parameter_and_layer_added_mid_run, parametrization_registered_mid_run, fuse_linear_bn_for_evaluation,
    state_dict_hooks_round_trip, model_to_float64_mid_run, optimizer_step_hooks_project_weights,
    rprop_and_asgd_on_disjoint_groups, clip_grads_with_total_norm, cpu_grad_scaler_enabled,
    cyclic_lr_momentum_cycling,
)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_models_and_values_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)


def test_the_rows_really_meet_what_they_handle() -> None:
    """The infinities are really there (the -inf segment max of a node with no edge, the +inf of an empty class,
    the fully masked logsumexp row, an empty bag), and the unwatched loops end with finite gradients."""
    torch.manual_seed(0)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])
    best = torch.full((5,), INF).scatter_reduce(0, y, torch.rand(8), "amin", include_self=True)
    assert torch.isinf(best[3:]).all()
    top = torch.full((8,), -INF).scatter_reduce(0, torch.tensor([1, 2, 0]), torch.rand(3), "amax")
    assert torch.isneginf(top[3:]).all()
    keep = torch.rand(8, 5) > 0.5
    keep[2] = False
    assert torch.isneginf(torch.randn(8, 5).masked_fill(~keep, -INF).amax(-1)[2])
    bag = Bag()
    empty = bag.bag(torch.tensor([3, 0, 5, 7, 7]), torch.tensor([0, 3, 5]), per_sample_weights=torch.rand(5))
    assert torch.equal(empty[2], torch.zeros(8))
    for name, build in ROWS.items():
        torch.manual_seed(0)
        row = build()
        row.run(__import__("contextlib").nullcontext)
        for held in row.held:
            if isinstance(held, nn.Module):
                assert all(p.grad is None or torch.isfinite(p.grad).all() for p in held.parameters()), name
