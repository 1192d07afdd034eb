"""hunt_s31, incidents of families the contract had not seen, each a small training loop with its healthy twin.

Image, geometry and sequence losses: an isotropic total-variation loss ``sqrt(dx^2 + dy^2)`` on a super-resolution
output whose last layer is nearest upsampling (neighbouring pixels equal: the square root's backward at 0); mesh face
normals ``n / |n|`` of a degenerate face in a template mesh with a duplicated vertex; soft-DTW written with
``-gamma * log(sum(exp(-r / gamma)))`` whose small gamma underflows every term. Statistics: an MMD domain
adaptation loss whose median-heuristic bandwidth is 0 on a batch of duplicated samples; a WTTE-RNN Weibull
likelihood given an event at time 0; RankMe's effective rank from ``eigvalsh`` of a rank-deficient covariance
(``log`` of a rounding-negative eigenvalue); MINE's Donsker-Varadhan bound ``log(mean(exp(T)))`` as the statistics
network grows. Sequences: a linear recurrence's convolution kernel ``C A^k B`` by ``matrix_power`` on a long sequence.
Each twin applies its users' fix and must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- total variation of a nearest-upsampled output
class NearestSR(nn.Module):
    """A 2x super-resolution net whose last layer is nearest upsampling (each 2x2 block holds one value)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1))
        self.up = nn.Upsample(scale_factor=2, mode="nearest")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.body(x))


def _tv_loss(img: torch.Tensor, eps: float) -> torch.Tensor:
    dx, dy = img[..., 1:, :-1] - img[..., :-1, :-1], img[..., :-1, 1:] - img[..., :-1, :-1]
    return torch.sqrt(dx**2 + dy**2 + eps).mean()  # producer: tv sqrt


def _tv(eps: float) -> Scenario:
    """L1 reconstruction plus 0.1 isotropic TV: inside each upsampled 2x2 block both differences are exactly 0,
    ``sqrt(0)``'s backward is ``g / 0``, at the first backward. The twin adds 1e-8 under the root."""
    torch.manual_seed(0)
    model = NearestSR()
    xs, ys = _batches(2, 1, 4, 4), _batches(2, 1, 8, 8)
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: F.l1_loss(out, ys[step]) + 0.1 * _tv_loss(out, eps))


# ---------------------------------------------------------------- MMD with a median-heuristic bandwidth of 0
def _mmd(source: torch.Tensor, target: torch.Tensor, floor: float) -> torch.Tensor:
    joint = torch.cat([source, target])
    d2 = torch.cdist(joint, joint) ** 2
    bandwidth = d2.detach().median().clamp(min=floor)
    kernel = torch.exp(-d2 / bandwidth)  # producer: mmd bandwidth
    n = len(source)
    return kernel[:n, :n].mean() + kernel[n:, n:].mean() - 2 * kernel[:n, n:].mean()


def _mmd_da(floor: float) -> Scenario:
    """Domain adaptation (DAN): cross-entropy on labelled source images plus the MMD between source and target
    features, the kernel's bandwidth the median squared distance. Step 2's batches come from a class-balanced sampler
    that, for a class with one image in each domain, repeats it: half the pairwise distances are 0, the median is 0
    and the diagonal's ``0 / 0`` is NaN. The twin floors the bandwidth at 1e-6."""
    torch.manual_seed(0)
    encoder, head = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4)), nn.Linear(4, 3)
    model = nn.ModuleDict({"encoder": encoder, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sources, targets = _batches(6, 6), _batches(6, 6)
    sources[2], targets[2] = sources[2][:1].repeat(6, 1), targets[2][:1].repeat(6, 1)
    labels = [torch.randint(0, 3, (6,)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            fs, ft = encoder(sources[step]), encoder(targets[step])
            loss = F.cross_entropy(head(fs), labels[step]) + 0.5 * _mmd(fs, ft, floor)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- WTTE-RNN: a Weibull likelihood at time 0
class WeibullRNN(nn.Module):
    """WTTE-RNN: a GRU over a customer's history, a Weibull (alpha, beta) per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.gru, self.head = nn.GRU(3, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = self.gru(x)
        a, b = self.head(h[:, -1]).unbind(-1)
        return a.exp() * 10.0, F.softplus(b) + 0.5


def _weibull_nll(out: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor, u: torch.Tensor,
                 floor: float) -> torch.Tensor:
    alpha, beta = out
    t = t.clamp(min=floor)
    log_t = torch.log(t / alpha)  # producer: weibull log
    return -(u * (torch.log(beta) + (beta - 1) * log_t - torch.log(alpha)) - (t / alpha) ** beta).mean()


def _weibull(floor: float) -> Scenario:
    """Time to the next purchase in days, ``u`` 1 for an observed event; step 2's batch holds a customer who bought
    again the same day: t = 0 and ``log(0)`` is -inf. The twin counts a same-day event as half a day."""
    torch.manual_seed(0)
    model = WeibullRNN()
    xs = _batches(4, 5, 3)
    ts = [torch.rand(4) * 30 + 1 for _ in range(4)]
    ts[2][1] = 0.0
    us = [torch.tensor([1.0, 1.0, 0.0, 1.0]) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: _weibull_nll(out, ts[step], us[step], floor))


# ---------------------------------------------------------------- a linear recurrence's kernel by matrix_power
class LinearRecurrence(nn.Module):
    """``h_t = A h_{t-1} + B x_t, y_t = C h_t`` computed as a causal convolution with the kernel ``K_k = C A^k B``."""

    def __init__(self, stable: bool) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.eye(4) * 1.3 + torch.randn(4, 4) * 0.05)
        self.B, self.C, self.stable = nn.Parameter(torch.randn(4, 1)), nn.Parameter(torch.randn(1, 4)), stable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        A = self.A / self.A.abs().sum(1).max().clamp(min=1.0) if self.stable else self.A
        kernel = torch.stack([(self.C @ torch.linalg.matrix_power(A, k) @ self.B).squeeze()  # producer: kernel
                              for k in range(x.shape[1])])
        return torch.stack([(kernel[: t + 1].flip(0) * x[:, : t + 1]).sum(1) for t in range(x.shape[1])], 1)


def _recurrence(stable: bool) -> Scenario:
    """Sequences of 20 steps, and at step 2 one of 400: ``A^k`` with A's eigenvalues near 1.3 passes the float32
    maximum at k of about 340. The twin keeps A's infinity norm at most 1, a stable recurrence."""
    torch.manual_seed(0)
    model = nn.Sequential(LinearRecurrence(stable), nn.Tanh())
    xs = [torch.randn(2, 20) * 0.1 for _ in range(4)]
    xs[2] = torch.randn(2, 400) * 0.1
    return _loop(model, lambda step: (xs[step],), lambda out, step: out[:, -1].pow(2).mean())


# ---------------------------------------------------------------- soft-DTW with exp and log
def _soft_dtw(x: torch.Tensor, y: torch.Tensor, gamma: float, stable: bool, border: str) -> torch.Tensor:
    """Soft-DTW's table of cumulative costs, its border +inf: a lifted literal, or ``torch.full``'s fill."""
    cost = torch.cdist(x, y) ** 2
    n, m = cost.shape
    inf = torch.tensor(float("inf")) if border == "literal" else torch.full((), float("inf"))
    rows = [[torch.tensor(0.0)] + [inf] * m] + [[inf] + [inf] * m for _ in range(n)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            prev = torch.stack([rows[i - 1][j - 1], rows[i - 1][j], rows[i][j - 1]])
            if stable:
                soft_min = -gamma * torch.logsumexp(-prev / gamma, 0)
            else:
                soft_min = -gamma * torch.log(torch.exp(-prev / gamma).sum())  # producer: softdtw log
            rows[i][j] = cost[i - 1, j - 1] + soft_min
    return rows[n][m]


class Forecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).view(-1, 6, 1)


def _softdtw(stable: bool, border: str = "literal") -> Scenario:
    """A forecaster trained with soft-DTW (gamma 0.01) against the next 6 values; step 2's target has a spike of
    20 (an unfiltered sensor glitch): every path's cost divided by gamma is past 104, each ``exp`` underflows to 0
    and ``log(0)`` makes the distance +inf. The twin takes the softmin by ``logsumexp``, as tslearn does. The table's
    border is a deliberate +inf, lifted from a literal (``torch.tensor(float("inf"))``) or filled by ``torch.full``:
    the default, deferred and full modes named the literal border as bad input data at the ``stack`` that read it."""
    torch.manual_seed(0)
    model = Forecaster()
    xs, ys = _batches(1, 6), [torch.randn(6, 1) * 0.3 for _ in range(4)]
    ys[2][3] = 20.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: _soft_dtw(out[0], ys[step], 0.01, stable, border))


# ---------------------------------------------------------------- face normals of a degenerate face
class MeshDeformer(nn.Module):
    """Pixel2Mesh-like: per-vertex offsets of a template mesh from an image feature."""

    def __init__(self, n_vertices: int) -> None:
        super().__init__()
        self.net, self.n = nn.Linear(8, n_vertices * 3), n_vertices

    def forward(self, feat: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
        return template + 0.1 * self.net(feat).view(self.n, 3).tanh()


def _normal_loss(vertices: torch.Tensor, faces: torch.Tensor, target_normals: torch.Tensor, eps: float) -> torch.Tensor:
    v0, v1, v2 = vertices[faces[:, 0]], vertices[faces[:, 1]], vertices[faces[:, 2]]
    n = torch.linalg.cross(v1 - v0, v2 - v0)
    n = n / (n.norm(dim=-1, keepdim=True) + eps)  # producer: face normal
    return (1 - (n * target_normals).sum(-1)).mean()


def _mesh(eps: float) -> Scenario:
    """Each sample is an image feature and its object's template mesh; step 2's mesh came out of a decimation tool
    with a collapsed face (two equal vertex indices): its edge is 0, the cross product 0 and ``0 / 0``. The twin adds
    an eps to the norm, as PyTorch3D's mesh normal consistency does."""
    torch.manual_seed(0)
    model = MeshDeformer(6)
    feats = _batches(8)
    templates = [torch.randn(6, 3) for _ in range(4)]
    faces = [torch.tensor([[0, 1, 2], [0, 2, 3], [3, 4, 5], [1, 4, 5]]) for _ in range(4)]
    faces[2] = torch.tensor([[0, 1, 2], [0, 2, 3], [3, 3, 4], [1, 4, 5]])
    normals = [F.normalize(torch.randn(4, 3), dim=-1) for _ in range(4)]
    return _loop(model, lambda step: (feats[step], templates[step]),
                 lambda out, step: _normal_loss(out, faces[step], normals[step], eps))


# ---------------------------------------------------------------- NFNet's adaptive gradient clipping without its eps
def _unitwise_norm(t: torch.Tensor) -> torch.Tensor:
    return t.norm(dim=-1, keepdim=True) if t.ndim > 1 else t.abs()


def _agc_loop(eps: float) -> Scenario:
    """A bag-of-words classifier with a padding row (index 0, zero and never updated by its gradient), clipped by
    NFNet's AGC written by hand: each row's gradient scaled by ``min(1, 0.01 * max(|w|, eps) / |g|)``. Without the
    eps the padding row's ratio is ``0 / 0``, its gradient turns NaN after the first backward. The twin keeps the
    paper's eps of 1e-3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(20, 8, mode="mean", padding_idx=0), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = [torch.randint(1, 20, (4, 6)) for _ in range(4)]
    for batch in tokens:
        batch[:, 4:] = 0
    labels = [torch.randint(0, 2, (4,)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.cross_entropy(model(tokens[step]), labels[step])
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    max_norm = 0.01 * _unitwise_norm(p).clamp(min=eps)
                    p.grad.mul_(torch.clamp(max_norm / _unitwise_norm(p.grad), max=1.0))  # producer: agc ratio
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- RankMe: log of a rounding-negative eigenvalue
def _rankme(z: torch.Tensor, floor: float | None) -> torch.Tensor:
    centred = z - z.mean(0)
    eigvals = torch.linalg.eigvalsh(centred.T @ centred / len(z))
    if floor is not None:
        eigvals = eigvals.clamp(min=floor)
    p = eigvals / eigvals.sum()
    return -(p * torch.log(p)).sum().exp()  # producer: rankme log


def _rank_reg(floor: float | None) -> Scenario:
    """A self-supervised encoder regularised to a high effective rank (RankMe, the exponential of the spectrum's
    entropy), batch 6 and embeddings of 16: the covariance has rank 5, its null eigenvalues come out of ``eigvalsh``
    as +-1e-8 and ``log`` of a negative one is NaN. The twin clamps the spectrum at 1e-12."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    xs = _batches(6, 8)
    views = [x + 0.1 * torch.randn_like(x) for x in xs]
    return _loop(model, lambda step: (torch.cat([xs[step], views[step]]),),
                 lambda out, step: F.mse_loss(out[:6], out[6:]) - 0.01 * _rankme(out[:6], floor))


# ---------------------------------------------------------------- group DRO with a group absent from the batch
def _group_dro(guarded: bool) -> Scenario:
    """Group DRO (Sagawa et al.): each group's mean loss, exponentiated-gradient weights over the groups. Step 2's
    batch holds no sample of group 3: its mean is ``0 / 0``, NaN in the weights and the loss. The twin divides by
    ``count + (count == 0)``, as the authors' code does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(8, 5), [torch.randint(0, 2, (8,)) for _ in range(4)]
    groups = [torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]) for _ in range(4)]
    groups[2] = torch.tensor([0, 1, 2, 0, 0, 1, 2, 1])
    weights = torch.ones(4) / 4

    def run() -> list[torch.Tensor]:
        nonlocal weights
        losses = []
        for step in range(4):
            per_sample = F.cross_entropy(model(xs[step]), ys[step], reduction="none")
            onehot = F.one_hot(groups[step], 4).float()
            count = onehot.sum(0)
            if guarded:
                count = count + (count == 0).float()
            group_loss = onehot.T @ per_sample / count  # producer: group mean
            weights = weights * torch.exp(0.01 * group_loss.detach())
            weights = weights / weights.sum()
            loss = (weights * group_loss).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- prioritized replay with a priority of 0
def _per(new_priority: float) -> Scenario:
    """DQN with prioritized experience replay: a transition's sampling probability ``p^0.6 / sum``, its
    importance weight ``(N P)^-0.4`` over the largest. The buffer stores new transitions with priority 0 instead
    of the largest seen; step 2 samples one of them: ``0^-0.4`` is inf and inf / inf is NaN. The twin stores new
    transitions with priority 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    states, actions, targets = _batches(16, 4), [torch.randint(0, 2, (16,)) for _ in range(4)], _batches(16)
    priorities = torch.rand(64) + 0.1
    priorities[60:] = new_priority
    picks = [torch.randint(0, 60, (16,)) for _ in range(4)]
    picks[2][5] = 62

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            probs = priorities**0.6 / (priorities**0.6).sum()
            w = (64 * probs[picks[step]]) ** -0.4  # producer: per weights
            w = w / w.max()
            q = model(states[step]).gather(1, actions[step][:, None]).squeeze(1)
            td = q - targets[step]
            loss = (w * F.smooth_l1_loss(q, targets[step], reduction="none")).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            priorities[picks[step]] = td.detach().abs() + 1e-3
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- MINE: log of a mean of exp
class StatisticsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, z], -1)).squeeze(-1)


def _mine(stable: bool) -> Scenario:
    """MINE's Donsker-Varadhan bound ``mean(T(x, z)) - log(mean(exp(T(x, z'))))`` maximised with a learning rate of
    0.1 on strongly dependent pairs. Step 2's batch is in other units (one feature 1000 times larger): its update
    grows T, and at step 3 a shuffled pair scores past 88 and its ``exp`` overflows. The twin takes
    ``logsumexp(T) - log(n)``."""
    torch.manual_seed(0)
    model = StatisticsNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(32, 2) for _ in range(4)]
    zs = [x * 3 + 0.1 * torch.randn(32, 2) for x in xs]
    zs[2][:, 0] *= 1000.0  # a batch in other units
    perms = [torch.randperm(32) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            joint, marginal = model(xs[step], zs[step]), model(xs[step], zs[step][perms[step]])
            if stable:
                log_mean_exp = torch.logsumexp(marginal, 0) - torch.log(torch.tensor(32.0))
            else:
                log_mean_exp = torch.log(torch.exp(marginal).mean())  # producer: mine exp
            loss = -(joint.mean() - log_mean_exp)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


#: Why the literal border's row fails where the loss code is replayed, not traced (tests/test_hunt_s31.py).
_LITERAL_BORDER = ("soft-DTW's border lifted from a literal (torch.tensor(float('inf'))) is named bad input data where "
                   "it was stacked: a lifted infinity cannot be told from one lifted from data (a label, a reward)")

CASES = [
    Case("hunt_s31_total_variation_of_a_nearest_upsampled_output", lambda: _tv(0.0),
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="tv sqrt", cause="sqrt-domain")),
    Case("hunt_s31_total_variation_smoothed_healthy", lambda: _tv(1e-8), None),
    Case("hunt_s31_mmd_median_bandwidth_0_on_a_repeated_batch", lambda: _mmd_da(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="mmd bandwidth", cause="division-by-zero")),
    Case("hunt_s31_mmd_bandwidth_floored_healthy", lambda: _mmd_da(1e-6), None),
    Case("hunt_s31_wtte_weibull_log_of_a_same_day_event", lambda: _weibull(0.0),
         Expect("forward", None, step=2, op="aten.log.default", marker="weibull log", cause="log-domain")),
    Case("hunt_s31_wtte_weibull_same_day_as_half_a_day_healthy", lambda: _weibull(0.5), None),
    Case("hunt_s31_linear_recurrence_matrix_power_on_a_long_sequence", lambda: _recurrence(False),
         Expect("forward", "0", "LinearRecurrence", step=2, op="aten.mm.default", marker="kernel", cause="overflow")),
    Case("hunt_s31_linear_recurrence_stable_healthy", lambda: _recurrence(True), None),
    Case("hunt_s31_soft_dtw_exp_log_underflow_on_a_spike", lambda: _softdtw(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="softdtw log", cause="log-domain"),
         gaps=tuple((mode, _LITERAL_BORDER) for mode in ("default", "defer", "full"))),
    Case("hunt_s31_soft_dtw_logsumexp_healthy", lambda: _softdtw(True), None),
    Case("hunt_s31_soft_dtw_full_border_exp_log_underflow_on_a_spike", lambda: _softdtw(False, "full"),
         Expect("forward", None, step=2, op="aten.log.default", marker="softdtw log", cause="log-domain")),
    Case("hunt_s31_soft_dtw_full_border_logsumexp_healthy", lambda: _softdtw(True, "full"), None),
    Case("hunt_s31_mesh_normal_of_a_collapsed_face", lambda: _mesh(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="face normal", cause="division-by-zero")),
    Case("hunt_s31_mesh_normal_with_eps_healthy", lambda: _mesh(1e-6), None),
    Case("hunt_s31_agc_without_eps_on_a_padding_row", lambda: _agc_loop(0.0),
         # (the loop's clipping code made it, outside every module; the gradient keeps its owner's name)
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="agc ratio",
                tensor=TensorRef.gradient("0.weight"), cause="division-by-zero")),
    Case("hunt_s31_agc_with_eps_healthy", lambda: _agc_loop(1e-3), None),
    Case("hunt_s31_rankme_log_of_a_negative_eigenvalue", lambda: _rank_reg(None),
         Expect("forward", None, step=0, op="aten.log.default", marker="rankme log", cause="log-domain")),
    Case("hunt_s31_rankme_spectrum_clamped_healthy", lambda: _rank_reg(1e-12), None),
    Case("hunt_s31_group_dro_group_absent_from_the_batch", lambda: _group_dro(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="group mean", cause="division-by-zero")),
    Case("hunt_s31_group_dro_count_guarded_healthy", lambda: _group_dro(True), None),
    Case("hunt_s31_prioritized_replay_priority_0_weight", lambda: _per(0.0),
         Expect("forward", None, step=2, op="aten.pow.Tensor_Scalar", marker="per weights", cause="pow-domain")),
    Case("hunt_s31_prioritized_replay_priority_1_healthy", lambda: _per(1.0), None),
    Case("hunt_s31_mine_donsker_varadhan_exp_overflow", lambda: _mine(False),
         Expect("forward", None, step=3, op="aten.exp.default", marker="mine exp", cause="exp-overflow")),
    Case("hunt_s31_mine_logsumexp_healthy", lambda: _mine(True), None),
]
