"""hunt_s30, incidents of families the contract had not seen, each a small training loop with its healthy twin.

Reinforcement and density models: C51's distributional loss as ``log`` of a softmax atom that underflowed on an
unnormalised observation; a heteroscedastic Student-t head (``torch.distributions.StudentT`` without argument
validation) whose degrees of freedom ``softplus`` underflows to 0 on an outlier; PixelCNN++'s discretised logistic
likelihood, ``log`` of a difference of two sigmoids that round to the same value; denoising score matching whose
target ``-noise / sigma**2`` meets the last, 0, level of a linear schedule; soft k-means responsibilities written as
``exp`` over its sum, which underflows for a far sample. Detection: GIoU over anchor slots padded with zero boxes.
Sequence and continuous-time models: an ODE-RNN whose linear flow ``matrix_exp(A * dt)`` overflows on a long
observation gap; a hand fixed-step RK4 neural ODE over a stiff field; an attention bias ``-log|i - j|`` that is
+inf on the diagonal (and T5's relative position bucket, whose ``log`` of distance 0 is discarded by a ``where``:
healthy). Training tricks: an energy model's Langevin sampler (``torch.autograd.grad`` inside the loop) with a step
too large for the energy's curvature; log-sum-exp pooling whose sharpness is annealed to 0; a hand quantisation-aware
training fake quantiser whose min-max scale of a dead channel is 0.
Each twin applies its users' fix and must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- C51: log of an underflowed atom
class C51(nn.Module):
    """A distributional Q-network: 51 atoms per action."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2 * 51))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.net(state).view(-1, 2, 51)


def _c51_loss(logits: torch.Tensor, actions: torch.Tensor, target: torch.Tensor, stable: bool) -> torch.Tensor:
    chosen = logits[torch.arange(len(actions)), actions]
    log_p = chosen.log_softmax(-1) if stable else chosen.softmax(-1).log()  # producer: c51 log
    return -(target * log_p).sum(-1).mean()


def _c51(stable: bool) -> Scenario:
    """Step 2's batch holds an unnormalised observation (a raw score of 4000): its atoms' logits spread by
    thousands, most atoms' probabilities underflow to 0 and their log is -inf. The twin takes ``log_softmax``."""
    torch.manual_seed(0)
    model = C51()
    states, actions = _batches(4, 4), [torch.randint(0, 2, (4,)) for _ in range(4)]
    states[2][1] = torch.tensor([4000.0, -3000.0, 2500.0, 1.0])
    targets = [torch.randn(4, 51).softmax(-1) for _ in range(4)]  # a projected Bellman target, as given
    return _loop(model, lambda step: (states[step],),
                 lambda out, step: _c51_loss(out, actions[step], targets[step], stable))


# ---------------------------------------------------------------- Student-t head: df underflows on an outlier
class StudentTHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.loc, self.scale, self.df = nn.Linear(4, 16), nn.Linear(16, 1), nn.Linear(16, 1), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.loc(h), F.softplus(self.scale(h)) + 1e-3, self.df(x)


def _studentt_nll(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], y: torch.Tensor, bounded: bool) -> torch.Tensor:
    loc, scale, raw_df = out
    df = F.softplus(raw_df) + 2.0 if bounded else raw_df.exp()  # producer: student t
    return -torch.distributions.StudentT(df, loc, scale).log_prob(y).mean()


def _studentt(bounded: bool) -> Scenario:
    """A robust regression head: the degrees of freedom are ``exp`` of a head read straight off the input; step 2's
    batch has a sensor glitch (readings of 1e3) that drives the df head to about +1000 and ``exp`` overflows (StudentT
    accepts an infinite df; its log-density is then NaN). The twin takes ``softplus(raw) + 2``."""
    torch.manual_seed(0)
    model = StudentTHead()
    xs, ys = _batches(4, 4), _batches(4, 1)
    xs[2][3] = 1000.0 * model.df.weight.detach()[0].sign()
    return _loop(model, lambda step: (xs[step],), lambda out, step: _studentt_nll(out, ys[step], bounded), steps=3)


# ---------------------------------------------------------------- GIoU over anchor slots padded with zero boxes
class BoxHead(nn.Module):
    """Per-anchor box deltas decoded against the anchors (cx, cy, w, h), into corner boxes."""

    def __init__(self) -> None:
        super().__init__()
        self.delta = nn.Linear(8, 4)

    def forward(self, feats: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        d = self.delta(feats)
        cx, cy = anchors[..., 0] + d[..., 0] * anchors[..., 2], anchors[..., 1] + d[..., 1] * anchors[..., 3]
        w, h = anchors[..., 2] * d[..., 2].exp(), anchors[..., 3] * d[..., 3].exp()
        return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def _giou_loss(pred: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    area_p = (pred[..., 2] - pred[..., 0]) * (pred[..., 3] - pred[..., 1])
    area_t = (target[..., 2] - target[..., 0]) * (target[..., 3] - target[..., 1])
    lt, rb = torch.maximum(pred[..., :2], target[..., :2]), torch.minimum(pred[..., 2:], target[..., 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area_p + area_t - inter
    iou = inter / (union + eps)  # producer: giou iou
    lt_c, rb_c = torch.minimum(pred[..., :2], target[..., :2]), torch.maximum(pred[..., 2:], target[..., 2:])
    hull = (rb_c - lt_c).prod(-1)
    return (1 - iou + (hull - union) / (hull + eps)).mean()


def _giou(eps: float) -> Scenario:
    """Images have up to 3 anchors matched; step 2's image has 2, its third slot padded with zeros (anchor and target):
    the decoded box and the target are both empty, ``0 / 0``. The twin adds torchvision's eps of 1e-7."""
    torch.manual_seed(0)
    model = BoxHead()
    feats = _batches(2, 3, 8)
    anchors = [torch.rand(2, 3, 4) * 0.5 + 0.25 for _ in range(4)]
    targets = [torch.cat([a[..., :2] - a[..., 2:] / 2, a[..., :2] + a[..., 2:] / 2], -1) + 0.01 for a in anchors]
    anchors[2][1, 2], targets[2][1, 2] = 0.0, 0.0
    return _loop(model, lambda step: (feats[step], anchors[step]),
                 lambda out, step: _giou_loss(out, targets[step], eps))


# ---------------------------------------------------------------- ODE-RNN: matrix_exp over a long gap
class LinearFlow(nn.Module):
    """The hidden state's flow between observations, ``h(t + dt) = exp(A dt) h(t)``."""

    def __init__(self) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.randn(8, 8) * 0.1)

    def forward(self, h: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        flow = torch.linalg.matrix_exp(self.A * dt[:, None, None])  # producer: matrix exp
        return (flow @ h[..., None]).squeeze(-1)


class ODERNN(nn.Module):
    def __init__(self, max_gap: float) -> None:
        super().__init__()
        self.flow, self.cell, self.head, self.max_gap = LinearFlow(), nn.GRUCell(3, 8), nn.Linear(8, 1), max_gap

    def forward(self, x: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 8)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], self.flow(h, dt[:, t].clamp(max=self.max_gap)))
        return self.head(h)


def _ode_rnn(max_gap: float) -> Scenario:
    """Irregularly sampled vitals, gaps in hours; step 2's batch has a patient with a 600-hour gap between visits and
    ``exp(A * 600)`` overflows. The twin caps the gap at 10 hours, as such models cap time since last observation."""
    torch.manual_seed(0)
    model = ODERNN(max_gap)
    xs, ys = _batches(3, 5, 3), _batches(3, 1)
    gaps = [torch.rand(3, 5) * 2 for _ in range(4)]
    gaps[2][0, 3] = 600.0
    return _loop(model, lambda step: (xs[step], gaps[step]), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- attention bias -log|i - j|
class LogDistanceAttention(nn.Module):
    """Self-attention with a distance penalty ``-slope * log|i - j|`` (``log1p`` in the twin); at i == j the penalty
    is +inf, and the softmax of a row holding +inf is NaN."""

    def __init__(self, shifted: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.shifted = nn.Linear(8, 24), nn.Linear(8, 8), shifted
        self.slope = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        pos = torch.arange(x.shape[1])
        dist = (pos[:, None] - pos[None, :]).abs().float()
        penalty = dist.log1p() if self.shifted else dist.log()  # producer: log distance
        scores = q @ k.transpose(-2, -1) / math.sqrt(8) - self.slope * penalty
        return self.out(scores.softmax(-1) @ v)


class LogDistanceEncoder(nn.Module):
    def __init__(self, shifted: bool) -> None:
        super().__init__()
        self.attn, self.head = LogDistanceAttention(shifted), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x).mean(1))


def _log_distance(shifted: bool) -> Scenario:
    torch.manual_seed(0)
    model = LogDistanceEncoder(shifted)
    xs, ys = _batches(2, 5, 8), [torch.randint(0, 2, (2,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]))


class T5Attention(nn.Module):
    """T5's relative position bias: the bucket of a large distance is ``log(distance / max_exact)``, computed for
    every distance (``log(0)`` is -inf, cast to an integer) and discarded by ``torch.where`` for the small ones."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out, self.bias = nn.Linear(8, 24), nn.Linear(8, 8), nn.Embedding(8, 1)

    @staticmethod
    def bucket(relative: torch.Tensor, num_buckets: int = 8, max_distance: int = 32) -> torch.Tensor:
        relative = relative.abs()
        max_exact = num_buckets // 2
        is_small = relative < max_exact
        large = max_exact + (torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
                             * (num_buckets - max_exact)).to(torch.long)
        large = torch.min(large, torch.full_like(large, num_buckets - 1))
        return torch.where(is_small, relative, large)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        pos = torch.arange(x.shape[1])
        bias = self.bias(self.bucket(pos[None, :] - pos[:, None])).squeeze(-1)
        return self.out((q @ k.transpose(-2, -1) + bias).softmax(-1) @ v)


def _t5() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), T5Attention(), nn.Linear(8, 1))
    xs, ys = _batches(2, 12, 4), _batches(2, 12, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- denoising score matching at sigma 0
class ScoreNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 32), nn.SiLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, sigma[:, None].log1p()], -1))


def _dsm(sigma_min: float) -> Scenario:
    """NCSN's loss ``sigma^2 * |s(x + sigma z, sigma) + z / sigma|^2`` with a schedule ``linspace(1, sigma_min, 10)``;
    written with ``sigma_min = 0`` the last level is 0 and step 1 draws it: ``-noise / sigma**2`` is ``0 / 0``. The
    twin ends the schedule at 0.01, as NCSN does."""
    torch.manual_seed(0)
    model = ScoreNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sigmas = torch.linspace(1.0, sigma_min, 10)
    xs = _batches(4, 4)
    levels = [torch.tensor([0, 4, 7, 2]), torch.tensor([3, 9, 1, 5]), torch.tensor([8, 6, 2, 0]),
              torch.tensor([1, 1, 4, 9])]
    zs = _batches(4, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            sigma = sigmas[levels[step]]
            noise = zs[step] * sigma[:, None]
            target = -noise / sigma[:, None] ** 2  # producer: dsm target
            score = model(xs[step] + noise, sigma)
            loss = (sigma[:, None] ** 2 * (score - target) ** 2).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- discretised logistic: log of a cdf difference
class PixelHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_scale = self.net(x).chunk(2, 1)
        return mean, log_scale.clamp(min=-7.0)


def _logistic_nll(out: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, floor: float | None) -> torch.Tensor:
    """The discretised logistic likelihood of 8-bit pixels in [-1, 1], without PixelCNN++'s edge cases: the
    probability of a bin is ``sigmoid(upper) - sigmoid(lower)``."""
    mean, log_scale = out
    inv_s = torch.exp(-log_scale)
    centred = x - mean
    cdf_plus = torch.sigmoid(inv_s * (centred + 1 / 255))
    cdf_min = torch.sigmoid(inv_s * (centred - 1 / 255))
    delta = cdf_plus - cdf_min
    if floor is not None:
        delta = delta.clamp(min=floor)
    return -torch.log(delta).mean()  # producer: logistic bin


def _logistic(floor: float | None) -> Scenario:
    """Step 2's batch holds a saturated image (a white frame among natural ones): its pixels lie many scales away from
    the predicted mean, both sigmoids round to 1 in float32 and the bin's probability is 0: ``log(0)``. The twin
    clamps the probability at 1e-12, as PixelCNN++ does."""
    torch.manual_seed(0)
    model = PixelHead()
    with torch.no_grad():
        model.net[2].bias[1] = -3.0  # the scales a trained model has come to: tight
    xs = [torch.rand(2, 1, 6, 6) * 0.2 - 0.1 for _ in range(4)]
    xs[2][1] = 1.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: _logistic_nll(out, xs[step], floor))


# ---------------------------------------------------------------- soft k-means responsibilities underflow
class DeepCluster(nn.Module):
    """An encoder and learnable centroids; responsibilities ``exp(-d^2) / sum exp(-d^2)`` (``softmax(-d^2)`` in the
    twin)."""

    def __init__(self, stable: bool) -> None:
        super().__init__()
        self.encoder, self.stable = nn.Linear(6, 3), stable
        self.centroids = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)
        d2 = ((z[:, None, :] - self.centroids[None]) ** 2).sum(-1)
        if self.stable:
            return (-d2).softmax(-1)
        weights = torch.exp(-d2)
        return weights / weights.sum(-1, keepdim=True)  # producer: responsibilities


def _cluster_loss(r: torch.Tensor) -> torch.Tensor:
    """DEC's sharpened target, KL to the responsibilities."""
    target = (r**2 / r.sum(0)).detach()
    target = target / target.sum(-1, keepdim=True)
    return (target * (target.clamp(min=1e-12).log() - r.clamp(min=1e-12).log())).sum(-1).mean()


def _cluster(stable: bool) -> Scenario:
    """Step 2's batch holds an outlier (features scaled by 40, a unit mix-up): its squared distance to every centroid
    is past 104 and every ``exp(-d^2)`` underflows to 0: ``0 / 0``."""
    torch.manual_seed(0)
    model = DeepCluster(stable)
    xs = _batches(8, 6)
    xs[2][5] *= 40.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: _cluster_loss(out))


# ---------------------------------------------------------------- GCN over a sparse adjacency: D^-1/2 of degree 0
class SparseGCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = torch.sparse.mm(adj, self.l1(x)).relu()
        return torch.sparse.mm(adj, self.l2(h))


def _normalised_adjacency(edges: torch.Tensor, n: int, self_loops: bool) -> torch.Tensor:
    """``D^-1/2 A D^-1/2`` as a sparse COO tensor, the degree read off the rows (``A + I`` in the twin)."""
    if self_loops:
        edges = torch.cat([edges, torch.arange(n).repeat(2, 1)], 1)
    adjacency = torch.sparse_coo_tensor(edges, torch.ones(edges.shape[1]), (n, n)).coalesce()
    inv_sqrt = torch.sparse.sum(adjacency, 1).to_dense().pow(-0.5)  # producer: gcn degree
    i = adjacency.indices()
    return torch.sparse_coo_tensor(i, inv_sqrt[i[0]] * adjacency.values() * inv_sqrt[i[1]], (n, n))


def _sparse_gcn(self_loops: bool) -> Scenario:
    """Node classification over one graph per step, its edges directed as the crawl found them; step 1's graph has a
    node with no outgoing edge that another node links to: its degree is 0 and ``0 ** -0.5`` is inf in the sparse
    adjacency given to the model. The twin adds self loops, as Kipf and Welling's GCN does."""
    torch.manual_seed(0)
    model = SparseGCN()
    xs, ys = _batches(5, 4), [torch.randint(0, 2, (5,)) for _ in range(4)]
    edges = [torch.tensor([[0, 1, 1, 2, 3, 4], [1, 0, 2, 1, 4, 3]]), torch.tensor([[0, 1, 1, 2, 3], [1, 0, 2, 1, 4]]),
             torch.tensor([[0, 1, 2, 3, 4], [4, 2, 1, 0, 0]]), torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]])]
    return _loop(model, lambda step: (xs[step], _normalised_adjacency(edges[step], 5, self_loops)),
                 lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- stochastic depth scheduled up to a rate of 1
class DropPath(nn.Module):
    """Per-sample stochastic depth, the kept branches scaled by ``1 / keep`` (timm's; ``guarded``: only where
    ``keep > 0``, as timm guards it)."""

    def __init__(self, rate: float, guarded: bool) -> None:
        super().__init__()
        self.rate, self.guarded = rate, guarded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.rate == 0.0:
            return x
        keep = 1.0 - self.rate
        mask = x.new_empty(x.shape[0], 1).bernoulli_(keep)
        if self.guarded and keep == 0.0:
            return x * mask
        return x * mask.div_(keep)  # producer: drop path


class ResidualBlock(nn.Module):
    def __init__(self, rate: float, guarded: bool) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), DropPath(rate, guarded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.fc(x)))


def _drop_path(guarded: bool) -> Scenario:
    """The drop rates of a 4-block residual net are ``linspace(0, max_rate, depth)`` and the config's max rate is 1.0
    (meant: the keep rate): the last block's keep probability is 0, its mask all 0 and ``0 / 0`` is NaN at the
    first forward. The twin guards the scaling as timm does."""
    torch.manual_seed(0)
    rates = torch.linspace(0.0, 1.0, 4).tolist()
    model = nn.Sequential(*[ResidualBlock(rate, guarded) for rate in rates], nn.Linear(8, 2))
    xs, ys = _batches(4, 8), [torch.randint(0, 2, (4,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- an energy model's Langevin sampler, step too large
class QuadraticEnergy(nn.Module):
    """A learned energy with a quadratic confinement, ``net(x) + |x|^2 / 2``: its curvature is about 1."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.SiLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1) + 0.5 * (x**2).sum(-1)


def _langevin(step_size: float) -> Scenario:
    """Contrastive divergence with 60 steps of Langevin sampling, ``x -= step * grad E(x)`` by ``torch.autograd.grad``
    in the loop. A step of 6 against a curvature of 1 multiplies the samples by about -5 a step: within the first
    sampling each sample's energy nears the float32 maximum and their sum, which the sampler differentiates,
    overflows. The twin's step is 0.1."""
    torch.manual_seed(0)
    model = QuadraticEnergy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data, starts = _batches(16, 2, steps=3), _batches(16, 2, steps=3)
    noise = [_batches(16, 2, steps=60) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            x = starts[step].clone().requires_grad_(True)
            for k in range(60):
                (grad,) = torch.autograd.grad(model(x).sum(), x)  # producer: sampler energy
                x = (x - step_size * grad + 0.01 * noise[step][k]).detach().requires_grad_(True)
            loss = model(data[step]).mean() - model(x.detach()).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a NaN in a jagged nested tensor batch
class SetPool(nn.Module):
    """Variable-length sets as one jagged nested tensor, each set's mean, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 2)

    def forward(self, sets: torch.Tensor) -> torch.Tensor:
        return self.head(torch.stack([members.mean(0) for members in sets.unbind()]))


def _nested(missing: bool) -> Scenario:
    """Step 1's second set has a missing reading, stored as NaN in the jagged batch the loop builds; the twin's
    reading is present."""
    torch.manual_seed(0)
    model = SetPool()
    sets = [[torch.randn(n, 3) for n in (2, 4, 3)] for _ in range(4)]
    if missing:
        sets[1][1][2, 0] = math.nan
    ys = _batches(3, 2)
    return _loop(model, lambda step: (torch.nested.nested_tensor(sets[step], layout=torch.jagged),),
                 lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a TorchScript-compiled log-compression frontend
class LogCompression(nn.Module):
    """A feature frontend, ``log(relu(fc(x)) + floor)``, compiled with TorchScript to ship with the model."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.fc, self.floor = nn.Linear(4, 4), floor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.relu(self.fc(x)) + self.floor)


def _scripted(floor: float, traced: bool) -> Scenario:
    """A unit of the frontend that the ReLU zeroes gives ``log(0)`` at the first forward; TorchScript has no Python
    frame inside, so the line is the loop's call of the model. The twin adds a floor of 1e-6."""
    torch.manual_seed(0)
    frontend = LogCompression(floor)
    compiled = torch.jit.trace(frontend, torch.randn(2, 4)) if traced else torch.jit.script(frontend)
    model = nn.Sequential(nn.Linear(4, 4), compiled, nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(4, 4), _batches(4, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])  # producer: scripted call
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES = [
    Case("hunt_s30_c51_log_of_a_softmax_atom_underflowed_on_a_raw_observation", lambda: _c51(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="c51 log", cause="log-domain")),
    Case("hunt_s30_c51_log_softmax_of_the_atoms_healthy", lambda: _c51(True), None),
    Case("hunt_s30_student_t_head_df_exp_overflows_on_a_glitch", lambda: _studentt(False),
         Expect("forward", None, step=2, op="aten.exp.default", marker="student t", cause="exp-overflow")),
    Case("hunt_s30_student_t_head_df_kept_above_2_healthy", lambda: _studentt(True), None),
    Case("hunt_s30_giou_of_a_padded_zero_anchor_and_target", lambda: _giou(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="giou iou", cause="division-by-zero")),
    Case("hunt_s30_giou_with_eps_healthy", lambda: _giou(1e-7), None),
    Case("hunt_s30_ode_rnn_matrix_exp_of_a_600_hour_gap", lambda: _ode_rnn(math.inf),
         Expect("forward", "flow", "LinearFlow", step=2, op="aten.linalg_matrix_exp.default", marker="matrix exp",
                cause="exp-overflow")),
    Case("hunt_s30_ode_rnn_gap_capped_healthy", lambda: _ode_rnn(10.0), None),
    Case("hunt_s30_attention_bias_minus_log_distance_on_the_diagonal", lambda: _log_distance(False),
         Expect("forward", "attn", "LogDistanceAttention", step=0, op="aten.log.default", marker="log distance",
                cause="log-domain")),
    Case("hunt_s30_attention_bias_minus_log1p_distance_healthy", lambda: _log_distance(True), None),
    Case("hunt_s30_t5_relative_bucket_log_of_distance_0_discarded_healthy", _t5, None),
    Case("hunt_s30_denoising_score_matching_at_a_sigma_of_0", lambda: _dsm(0.0),
         Expect("data", None, step=1, op="aten.div.Tensor", marker="dsm target", cause="division-by-zero")),
    Case("hunt_s30_denoising_score_matching_sigma_min_0_01_healthy", lambda: _dsm(0.01), None),
    Case("hunt_s30_discretised_logistic_log_of_a_bin_rounded_to_0", lambda: _logistic(None),
         Expect("forward", None, step=2, op="aten.log.default", marker="logistic bin", cause="log-domain")),
    Case("hunt_s30_discretised_logistic_bin_clamped_healthy", lambda: _logistic(1e-12), None),
    Case("hunt_s30_soft_kmeans_responsibilities_of_a_far_outlier", lambda: _cluster(False),
         Expect("forward", "", "DeepCluster", step=2, op="aten.div.Tensor", marker="responsibilities",
                cause="division-by-zero")),
    Case("hunt_s30_soft_kmeans_responsibilities_as_softmax_healthy", lambda: _cluster(True), None),
    Case("hunt_s30_sparse_gcn_adjacency_degree_0_to_the_minus_half", lambda: _sparse_gcn(False),
         Expect("data", "", "SparseGCN", step=1, op="aten.pow.Tensor_Scalar", marker="gcn degree",
                cause="pow-domain")),
    Case("hunt_s30_sparse_gcn_adjacency_with_self_loops_healthy", lambda: _sparse_gcn(True), None),
    Case("hunt_s30_stochastic_depth_scheduled_up_to_a_drop_rate_of_1", lambda: _drop_path(False),
         Expect("forward", "3.drop", "DropPath", step=0, op="aten.div_.Tensor", marker="drop path",
                cause="division-by-zero")),
    Case("hunt_s30_stochastic_depth_keep_0_guarded_healthy", lambda: _drop_path(True), None),
    Case("hunt_s30_energy_model_langevin_step_too_large_for_its_curvature", lambda: _langevin(6.0),
         Expect("forward", None, step=0, op="aten.sum.default", marker="sampler energy")),
    Case("hunt_s30_energy_model_langevin_step_0_1_healthy", lambda: _langevin(0.1), None),
    # (Was: forward in the root's own code at input[0] of head, the first dense tensor holding the NaN: a nested
    # tensor is not read. The batch's nested tensors are read at the model's boundary by their values().)
    Case("hunt_s30_nan_in_a_jagged_nested_tensor_batch", lambda: _nested(True), Expect("data", "", "SetPool", step=1)),
    Case("hunt_s30_jagged_nested_tensor_batch_healthy", lambda: _nested(False), None),
    Case("hunt_s30_torchscript_scripted_frontend_log_of_a_relu", lambda: _scripted(0.0, False),
         Expect("forward", "1", "LogCompression", step=0, op="aten.log.default", marker="scripted call",
                cause="log-domain")),
    Case("hunt_s30_torchscript_scripted_frontend_with_a_floor_healthy", lambda: _scripted(1e-6, False), None),
    Case("hunt_s30_torchscript_traced_frontend_log_of_a_relu", lambda: _scripted(0.0, True),
         Expect("forward", "1", "LogCompression", step=0, op="aten.log.default", marker="scripted call",
                cause="log-domain")),
    Case("hunt_s30_torchscript_traced_frontend_with_a_floor_healthy", lambda: _scripted(1e-6, True), None),
]
