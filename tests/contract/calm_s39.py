"""calm_s39, healthy training that looks suspicious or runs rarely-seen code, silent and bit-identical in every mode.

Infinities on purpose: farthest point sampling (PointNet++) whose running minimum distance starts as a ``torch.full``
of ``inf`` made in the forward; a graph attention layer whose per-node maximum for the edge softmax starts at
``-inf`` (``scatter_reduce(amax)``), with a node that has no incoming edge (its maximum stays ``-inf``, never read).
Rare code: a quantile (pinball) loss over the levels 0 and 1 themselves; sparsemax attention by hand (sort, cumsum,
threshold: many weights exactly 0); the Lion optimizer by hand (``sign`` updates); an ensemble trained through
``torch.func.stack_module_state`` and ``vmap(functional_call)``; a custom parametrization (a symmetric weight) read
under ``parametrize.cached()``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call, stack_module_state
from torch.nn import functional as F
from torch.nn.utils import parametrize

from contract import Case, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- farthest point sampling from an inf running min
class PointSetAbstraction(nn.Module):
    """PointNet++'s sampling: ``k`` centroids by farthest point sampling, each described by a shared MLP."""

    def __init__(self, k: int = 4) -> None:
        super().__init__()
        self.k = k
        self.mlp = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 2)

    def forward(self, pts: torch.Tensor) -> torch.Tensor:
        b, n, _ = pts.shape
        with torch.no_grad():
            dist = torch.full((b, n), float("inf"))
            far = torch.zeros(b, dtype=torch.long)
            picks = []
            for _ in range(self.k):
                picks.append(far)
                centroid = pts[torch.arange(b), far][:, None]
                dist = torch.minimum(dist, (pts - centroid).pow(2).sum(-1))
                far = dist.argmax(-1)
            idx = torch.stack(picks, 1)
        centroids = pts.gather(1, idx[..., None].expand(-1, -1, 3))
        return self.head(self.mlp(centroids).max(1).values)


def _farthest_points() -> Scenario:
    torch.manual_seed(0)
    model = PointSetAbstraction()
    xs, ys = _batches(2, 10, 3), [torch.randint(0, 2, (2,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- graph attention with a node of no incoming edge
class GraphAttention(nn.Module):
    """One GAT layer written with ``scatter_reduce`` and ``index_add_`` (as PyG's softmax does)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=False)
        self.att_src, self.att_dst = nn.Parameter(torch.randn(d_out)), nn.Parameter(torch.randn(d_out))

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        e = F.leaky_relu((h * self.att_src).sum(-1)[src] + (h * self.att_dst).sum(-1)[dst], 0.2)
        n = x.shape[0]
        top = torch.full((n,), float("-inf")).scatter_reduce(0, dst, e, reduce="amax", include_self=True)
        w = torch.exp(e - top[dst])
        denom = torch.zeros(n).index_add_(0, dst, w)
        alpha = w / denom[dst]
        return torch.zeros(n, h.shape[1]).index_add_(0, dst, alpha[:, None] * h[src])


class TinyGAT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gat1, self.gat2 = GraphAttention(5, 8), GraphAttention(8, 3)

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        return self.gat2(F.elu(self.gat1(x, src, dst)), src, dst)


def _gat() -> Scenario:
    """Node 5 has outgoing edges but none incoming: its maximum stays ``-inf`` and its output row 0."""
    torch.manual_seed(0)
    model = TinyGAT()
    src = torch.tensor([0, 1, 2, 3, 4, 5, 5, 1])
    dst = torch.tensor([1, 2, 3, 4, 0, 0, 2, 0])
    xs, ys = _batches(6, 5), [torch.randint(0, 3, (6,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step], src, dst), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- pinball loss over the levels 0 and 1
def _pinball() -> Scenario:
    """A quantile regressor over the levels ``[0, 0.1, 0.5, 0.9, 1]`` (the extremes give a one-sided loss)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 5))
    levels = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0])
    xs, ys = _batches(8, 4), _batches(8, 1)

    def loss(pred: torch.Tensor, step: int) -> torch.Tensor:
        err = ys[step] - pred
        return torch.maximum(levels * err, (levels - 1) * err).mean()

    return _loop(model, lambda step: (xs[step],), loss)


# ---------------------------------------------------------------- sparsemax attention by hand
def sparsemax(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Martins and Astudillo's sparsemax: the Euclidean projection of ``z`` onto the simplex."""
    z_sorted = z.sort(dim, descending=True).values
    k = torch.arange(1, z.shape[dim] + 1, dtype=z.dtype)
    cumsum = z_sorted.cumsum(dim) - 1
    support = (k * z_sorted > cumsum).sum(dim, keepdim=True)
    tau = cumsum.gather(dim, support - 1) / support.to(z.dtype)
    return (z - tau).clamp_min(0)


class SparseAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        weights = sparsemax(4.0 * q @ k.transpose(-1, -2))
        return self.out((weights @ v).mean(1))


def _sparsemax() -> Scenario:
    torch.manual_seed(0)
    model = SparseAttention()
    xs, ys = _batches(3, 5, 8), [torch.randint(0, 3, (3,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- Lion by hand
class Lion(torch.optim.Optimizer):
    """Chen et al.'s Lion: the sign of an interpolated momentum, decoupled weight decay."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),  # type: ignore[no-untyped-def]
                 weight_decay: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - beta2)


def _lion() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    xs, ys = _batches(6, 6), [torch.randint(0, 3, (6,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]),
                 opt=Lion(model.parameters()))


# ---------------------------------------------------------------- an ensemble by stack_module_state and vmap
def _vmap_ensemble() -> Scenario:
    """Four MLPs stacked into one set of batched parameters, trained together by Adam through ``vmap``."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2)) for _ in range(4)]
    params, buffers = stack_module_state(members)  # type: ignore[arg-type]
    base = copy.deepcopy(members[0]).to("meta")
    holder = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(v) for k, v in params.items()})
    opt = torch.optim.Adam(holder.parameters(), lr=1e-3)
    xs, ys = _batches(6, 5), [torch.randint(0, 2, (6,)) for _ in range(4)]

    def member(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(base, (p, b), (x,))

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            stacked = {k: holder[k.replace(".", "_")] for k in params}
            logits = torch.vmap(member, in_dims=(0, 0, None))(stacked, buffers, xs[step])
            loss = F.cross_entropy(logits.flatten(0, 1), ys[step].repeat(4))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((holder, opt), run)


# ---------------------------------------------------------------- a custom parametrization read under cached()
class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


class SymmetricMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = parametrize.register_parametrization(nn.Linear(6, 6), "weight", Symmetric())
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with parametrize.cached():
            h = torch.tanh(self.mix(x))
            h = torch.tanh(self.mix(h))
        return self.head(h)


def _cached_parametrization() -> Scenario:
    torch.manual_seed(0)
    model = SymmetricMixer()
    xs, ys = _batches(5, 6), [torch.randint(0, 2, (5,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]))


CASES = [
    Case("calm_s39_farthest_point_sampling_from_an_inf_running_min", _farthest_points, None),
    Case("calm_s39_graph_attention_with_a_node_of_no_incoming_edge", _gat, None),
    Case("calm_s39_pinball_loss_over_the_levels_zero_and_one", _pinball, None),
    Case("calm_s39_sparsemax_attention_by_hand", _sparsemax, None),
    Case("calm_s39_lion_optimizer_by_hand", _lion, None),
    Case("calm_s39_ensemble_by_stack_module_state_and_vmap", _vmap_ensemble, None),
    Case("calm_s39_symmetric_parametrization_read_under_cached", _cached_parametrization, None),
]
