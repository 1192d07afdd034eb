"""hunt_s47, the training code of research fields as their reference code writes it, immediate and deferred.

A signed-distance net fitted with an eikonal loss (the gradient of the output by ``torch.autograd.grad(create_graph=
True)``, its norm pushed to 1), a memory bank of features refreshed by the loop after each step and read as negatives
at the next, a graph attention layer written with ``scatter_reduce`` whose edge dropout masks scores with -inf, a
detection head's box regression targets ``log(w_gt / w_anchor)`` encoded in the loop, and an improved-DDPM variational
bound reading a posterior log-variance that was never clipped. Each with its healthy twin.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario


# ---------------------------------------------------------------- an SDF net and its eikonal loss
class Sdf(nn.Module):
    """A ReLU MLP without biases (an SDF net of positional features): at the origin every unit is at 0."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16, bias=False), nn.ReLU(), nn.Linear(16, 16, bias=False), nn.ReLU(),
                                 nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _eikonal(by_hand: bool) -> Scenario:
    """A circle's SDF fitted on points of the surface plus an eikonal term ``(|grad u| - 1)^2`` on random points of
    the domain; at step 2 the domain points are a grid through the origin, where the ReLU net's gradient is exactly 0.
    The norm written by hand, ``sqrt(sum(g^2))``, has the backward inf * 0 there (its forward is a finite 0). Twin:
    ``g.norm(dim=-1)``, whose backward is 0 at a zero vector."""
    torch.manual_seed(0)
    model = Sdf()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    angles = [torch.rand(16) * 6.2832 for _ in range(4)]
    domain = [torch.rand(16, 2) * 2 - 1 for _ in range(4)]
    grid = torch.linspace(-1, 1, 5)
    domain[2] = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            surface = 0.5 * torch.stack([angles[step].cos(), angles[step].sin()], -1)
            points = domain[step].requires_grad_(True)
            u = model(points)
            (g,) = torch.autograd.grad(u.sum(), points, create_graph=True)
            norm = torch.sqrt((g ** 2).sum(-1)) if by_hand else g.norm(dim=-1)  # producer: eikonal norm
            loss = model(surface).abs().mean() + 0.1 * ((norm - 1) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return [losses, [p.detach().clone() for p in model.parameters()]]

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a memory bank refreshed after each step
def _memory_bank(safe: bool) -> Scenario:
    """Instance discrimination (Wu et al.): each sample's normalised feature against a bank of every sample's last
    feature. After the step the loop writes the batch's features into the bank, normalised by hand; at step 1 an
    image is blank and its ReLU feature all 0: ``f / |f|`` is 0 / 0 in the bank. The loss reads it at step 2 (a NaN
    born in the loop's own code after step 1's update). Twin: F.normalize (its eps)."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
    with torch.no_grad():
        encoder[0].bias.fill_(-0.5)  # a blank image's features are all 0
    opt = torch.optim.SGD(encoder.parameters(), lr=0.01)
    bank = F.normalize(torch.randn(16, 8), dim=1)
    xs = [torch.randn(4, 6) * 3 for _ in range(4)]
    xs[1][2] = 0.0
    ids = [torch.arange(4) + 4 * step for step in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            f = encoder(xs[step])
            q = F.normalize(f, dim=1)
            logits = q @ bank.T / 0.1
            loss = F.cross_entropy(logits, ids[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                if safe:
                    bank[ids[step]] = F.normalize(f, dim=1)
                else:
                    bank[ids[step]] = f / f.norm(dim=1, keepdim=True)  # producer: bank update
            losses.append(loss.detach())
        return [losses, bank.clone()]

    return Scenario((encoder, opt), run)


# ---------------------------------------------------------------- graph attention with scatter_reduce
class ScatterGat(nn.Module):
    """One GAT layer over an edge list: scores per edge, a softmax per destination node by ``scatter_reduce``'s
    amax and a ``index_add_`` sum, messages summed by ``index_add_``. Edge dropout masks a dropped edge's score with
    -inf (a deliberate infinity)."""

    def __init__(self, guard: bool) -> None:
        super().__init__()
        self.lin, self.att = nn.Linear(4, 8), nn.Linear(16, 1)
        self.guard = guard

    def forward(self, x: torch.Tensor, edges: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        h = self.lin(x)
        score = F.leaky_relu(self.att(torch.cat([h[src], h[dst]], -1)).squeeze(-1), 0.2)
        score = score.masked_fill(~keep, float("-inf"))
        top = torch.full((x.shape[0],), float("-inf")).scatter_reduce(0, dst, score, "amax")
        if self.guard:
            top = top.clamp(min=-1e4)
        weight = (score - top[dst]).exp()  # producer: gat scores
        total = torch.zeros(x.shape[0]).index_add_(0, dst, weight)
        alpha = weight / total[dst].clamp(min=1e-16)
        return torch.zeros_like(h).index_add_(0, dst, alpha[:, None] * h[src])


def _gat(guard: bool) -> Scenario:
    """A ring of 6 nodes, each with its two neighbours as sources; at step 2 the edge dropout drops both edges into
    node 3: its max is -inf and ``score - top`` is -inf - (-inf). Twin: the max clamped at -1e4 (the dropped edges'
    weights are then exactly 0; node 3 gets a 0 message)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"gat": ScatterGat(guard), "head": nn.Linear(8, 1)})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    nodes = torch.arange(6)
    edges = torch.stack([torch.cat([(nodes + 1) % 6, (nodes - 1) % 6]), torch.cat([nodes, nodes])])
    xs = [torch.randn(6, 4) for _ in range(4)]
    ys = [torch.randn(6, 1) for _ in range(4)]
    keeps = [torch.cat([torch.rand(6) > 0.2, torch.ones(6, dtype=torch.bool)]) for _ in range(4)]
    keeps[2][[3, 9]] = False

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model["head"](model["gat"](xs[step], edges, keeps[step])), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- box regression targets encoded in the loop
def _box_targets(min_size: float) -> Scenario:
    """Faster R-CNN's box coder, in the loop: ``(log(w_gt / w_anchor), log(h_gt / h_anchor))`` targets of the matched
    anchors. At step 2 an annotation has zero width (a degenerate box of the dataset): ``log(0)``. Twin: boxes of
    width below 1 pixel clamped to 1 (as the dataset cleaning does)."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    anchors = torch.tensor([[16.0, 16.0], [32.0, 32.0], [64.0, 32.0], [32.0, 64.0]])
    feats = [torch.randn(4, 8) for _ in range(4)]
    gts = [anchors * (0.5 + torch.rand(4, 2)) for _ in range(4)]
    gts[2][1, 0] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            size = gts[step].clamp(min=min_size)
            wh = torch.log(size / anchors)  # producer: box targets
            offsets = torch.randn(4, 2, generator=torch.Generator().manual_seed(step)) * 0.1
            target = torch.cat([offsets, wh], -1)
            loss = F.smooth_l1_loss(head(feats[step]), target, beta=1 / 9)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((head, opt), run)


# ---------------------------------------------------------------- improved DDPM's learned variance
class LearnedVarianceDdpm(nn.Module):
    """Improved DDPM (Nichol & Dhariwal): the net predicts eps and an interpolation v between log beta and the
    posterior log-variance; the loss adds the variational bound's KL to the true posterior."""

    def __init__(self, clipped: bool, steps: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 32), nn.SiLU(), nn.Linear(32, 16))
        betas = torch.linspace(1e-4, 0.2, steps)
        alpha_bar = torch.cumprod(1 - betas, 0)
        previous = torch.cat([torch.ones(1), alpha_bar[:-1]])
        variance = betas * (1 - previous) / (1 - alpha_bar)  # 0 at t = 0
        if clipped:  # the reference: log of variance[1] in place of variance[0]
            variance = torch.cat([variance[1:2], variance[1:]])
        self.register_buffer("betas", betas)
        self.register_buffer("alpha_bar", alpha_bar)
        self.register_buffer("posterior_log_variance", torch.log(variance))

    def forward(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ab = self.alpha_bar[t][:, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        eps, v = self.net(torch.cat([xt, t[:, None].float() / 8], -1)).chunk(2, -1)
        true_log_var = self.posterior_log_variance[t][:, None]
        frac = (v + 1) / 2
        model_log_var = frac * self.betas[t][:, None].log() + (1 - frac) * true_log_var
        # KL between Gaussians of equal means (the mean term left out): the bound's variance term
        kl = 0.5 * (model_log_var - true_log_var + (true_log_var - model_log_var).exp() - 1)  # producer: vlb kl
        return F.mse_loss(eps, noise) + 1e-3 * kl.mean()


def _iddpm(clipped: bool) -> Scenario:
    """At step 2 a sample draws t = 0, whose posterior variance is 0: its log, computed in ``__init__``, is -inf,
    and the bound's ``true_log_var - model_log_var`` is -inf - (-inf). Twin: the reference's clipped log-variance."""
    torch.manual_seed(0)
    model = LearnedVarianceDdpm(clipped)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    xs = [torch.randn(4, 8) for _ in range(4)]
    noises = [torch.randn(4, 8) for _ in range(4)]
    ts = [torch.tensor(t) for t in ([3, 5, 1, 7], [2, 6, 4, 1], [5, 0, 3, 2], [1, 2, 3, 4])]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = model(xs[step], ts[step], noises[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


#: What the recorded modes say where the loss code's own autograd.grad(create_graph=True) made the failing gradient:
#: their trial replays its recorded backward ops on the tensors the model's forward saved, so it cannot fail.
GRAPH_GRAD = "torch.autograd.grad(create_graph=True) was run again as the ops it recorded"
RECORDED = ("default", "defer", "full")

CASES = [
    Case("hunt_s47_eikonal_norm_of_a_zero_gradient_at_the_origin", lambda: _eikonal(True),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="eikonal norm", cause="sqrt-domain",
                says=tuple((mode, GRAPH_GRAD) for mode in RECORDED))),
    Case("hunt_s47_eikonal_torch_norm_healthy", lambda: _eikonal(False), None),
    Case("hunt_s47_memory_bank_holds_a_blank_image_0_over_0", lambda: _memory_bank(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="bank update", cause="division-by-zero",
                kinds=frozenset({"nan"}))),
    Case("hunt_s47_memory_bank_normalized_healthy", lambda: _memory_bank(True), None),
    Case("hunt_s47_scatter_gat_edge_dropout_drops_every_edge_of_a_node", lambda: _gat(False),
         Expect("forward", "gat", "ScatterGat", step=2, op="aten.index.Tensor", marker="gat scores",
                cause="masked-softmax")),
    Case("hunt_s47_scatter_gat_max_clamped_healthy", lambda: _gat(True), None),
    Case("hunt_s47_box_targets_log_of_a_zero_width_annotation", lambda: _box_targets(0.0),
         Expect("data", None, step=2, op="aten.log.default", marker="box targets", cause="log-domain",
                kinds=frozenset({"-inf"}))),
    Case("hunt_s47_box_targets_width_clamped_healthy", lambda: _box_targets(1.0), None),
    Case("hunt_s47_iddpm_posterior_log_variance_unclipped_at_t_0", lambda: _iddpm(False),
         Expect("forward", "", "LearnedVarianceDdpm", step=2, cause="parameter-already-nonfinite",
                kinds=frozenset({"-inf"}), says=tuple((mode, "computed so before (in the module's __init__")
                                                      for mode in (*RECORDED, "ops")))),
    Case("hunt_s47_iddpm_posterior_log_variance_clipped_healthy", lambda: _iddpm(True), None),
]


# ---------------------------------------------------------------- a group-lasso penalty on the weights, by hand
def _group_lasso(by_hand: bool) -> Scenario:
    """A group-lasso penalty (each parameter's L2 norm, summed) in the loss code, the norm written by hand as
    ``sqrt(sum(p^2))``; the biases start at 0 (as most inits set them): the norm's backward is inf * 0 at step 0.
    Twin: ``p.norm()``, whose backward is 0 at a zero tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    for layer in (model[0], model[2]):
        nn.init.zeros_(layer.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(8, 6) for _ in range(3)], [torch.randn(8, 1) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            fit = F.mse_loss(model(xs[step]), ys[step])
            if by_hand:
                penalty = sum(torch.sqrt((p ** 2).sum()) for p in model.parameters())  # producer: group lasso
            else:
                penalty = sum(p.norm() for p in model.parameters())
            loss = fit + 1e-3 * penalty
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES += [
    # The tensor named differs: default, defer and full judge the gradients at opt.step() in the parameters' order
    # (0.bias); ops=True names the first made in backward (2.bias, whose penalty term ran last). Not asserted.
    Case("hunt_s47_group_lasso_sqrt_of_a_zero_bias", lambda: _group_lasso(True),
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="group lasso", cause="sqrt-domain",
                says=tuple((mode, "eps: the operand of sqrt clamped to at least 1.19e-7 (the float32 machine eps) "
                                  "-> verified") for mode in RECORDED))),
    Case("hunt_s47_group_lasso_torch_norm_healthy", lambda: _group_lasso(False), None),
]
