"""hunt_s28b_loops, the same models' incidents in the loop's own code and its phases, each with its twin.

PPO re-masking the logits at update time, so a stale action's log-probability is ``-inf`` (the loss code reads a
benign -inf fill); a Poincare embedding's Riemannian SGD whose exponential map normalises the zero gradient of an
isolated node (optimizer); a diffusion loop building the x0 target from a cached noisy latent at ``t = T`` of a
zero-terminal-SNR schedule (data); a GCN's normalised adjacency built in a ``collate_fn`` without self-loops (data); a
LightningModule-like GAN's minimax discriminator step with two optimizers; a policy's logits masked with -inf read
by a second watched model, whose softmax over a terminal position's row is the producer. Each twin applies its
users' fix and must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches


# ---------------------------------------------------------------- PPO re-masking the logits at update time
class MaskedPolicy(nn.Module):
    """A policy over 5 actions whose illegal actions are masked with ``-inf`` before the softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.net(obs).masked_fill(~legal, -math.inf)


def _ppo_mask(stored: bool) -> Scenario:
    """The update recomputes the legal actions from the environment's current state, not the rollout's: at step 2
    an action taken at rollout is now illegal, its log-probability is ``-inf`` and PPO's KL penalty
    ``mean(old - new)`` is inf. The twin uses the mask stored with the rollout, as CleanRL does."""
    torch.manual_seed(0)
    policy = MaskedPolicy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.01)
    obs, advantages = _batches(4, 6), _batches(4)
    legal_rollout = [torch.ones(4, 5, dtype=torch.bool) for _ in range(4)]
    for legal in legal_rollout:
        legal[:, 4] = False
    actions = [torch.tensor([0, 1, 2, 3]), torch.tensor([3, 2, 1, 0]), torch.tensor([1, 1, 3, 2]),
               torch.tensor([2, 0, 0, 1])]
    legal_now = [legal.clone() for legal in legal_rollout]
    legal_now[2][2, 3] = False  # the state moved on: action 3 is now illegal for sample 2
    with torch.no_grad():
        old_logp = [torch.log_softmax(policy(obs[s], legal_rollout[s]), -1).gather(-1, actions[s][:, None]).squeeze(-1)
                    for s in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            logits = policy(obs[step], legal_rollout[step] if stored else legal_now[step])
            logp = torch.log_softmax(logits, -1)
            new_logp = logp.gather(-1, actions[step][:, None]).squeeze(-1)  # producer: ppo stale action
            ratio = torch.exp(new_logp - old_logp[step])
            surrogate = torch.min(ratio * advantages[step], ratio.clamp(0.8, 1.2) * advantages[step])
            kl = (old_logp[step] - new_logp).mean()
            loss = -surrogate.mean() + 0.2 * kl
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((policy, opt), run)


# ---------------------------------------------------------------- Riemannian SGD on a Poincare embedding
def _mobius_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    xy, x2, y2 = (x * y).sum(-1, keepdim=True), x.pow(2).sum(-1, keepdim=True), y.pow(2).sum(-1, keepdim=True)
    return ((1 + 2 * xy + y2) * x + (1 - x2) * y) / (1 + 2 * xy + x2 * y2)


class RiemannianSGD(torch.optim.Optimizer):
    """SGD on the Poincare ball: the Euclidean gradient rescaled by the conformal factor, then the exponential map
    ``x (+) tanh(lambda |v| / 2) v / |v|``; geoopt clamps ``|v|`` from below, the slip does not."""

    def __init__(self, params, lr: float, min_norm: float) -> None:
        super().__init__(params, {"lr": lr, "min_norm": min_norm})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                lam = 2 / (1 - p.pow(2).sum(-1, keepdim=True))
                v = -group["lr"] * p.grad / lam ** 2
                norm = v.norm(dim=-1, keepdim=True).clamp(min=group["min_norm"])
                p.copy_(_mobius_add(p, torch.tanh(lam * norm / 2) * v / norm))  # producer: expmap direction
        return None


class PoincareGraph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.nodes = nn.Embedding(8, 2)
        with torch.no_grad():
            self.nodes.weight.uniform_(-0.3, 0.3)

    def forward(self, edges: torch.Tensor) -> torch.Tensor:
        u, v = self.nodes(edges[:, 0]), self.nodes(edges[:, 1])
        gap = (u - v).pow(2).sum(-1) / ((1 - u.pow(2).sum(-1)) * (1 - v.pow(2).sum(-1)))
        return torch.acosh(1 + 2 * gap)


def _poincare_rsgd(min_norm: float) -> Scenario:
    """Node 7 is isolated (in no edge): its row of the dense embedding gradient is 0, so is its Riemannian gradient,
    and the exponential map's direction ``v / |v|`` is ``0 / 0`` at the very first step. The twin clamps ``|v|``."""
    torch.manual_seed(0)
    model = PoincareGraph()
    opt = RiemannianSGD(model.parameters(), lr=0.05, min_norm=min_norm)
    edges = [torch.tensor([[0, 1], [1, 2], [3, 4], [5, 6]]), torch.tensor([[2, 3], [4, 5], [6, 0], [1, 3]])] * 2

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = model(edges[step]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a diffusion loop's x0 target at t = T
def _terminal_schedule(steps: int) -> torch.Tensor:
    """Lin et al.'s zero-terminal-SNR rescale of a linear schedule: alpha_bar is exactly 0 at t = T."""
    root = torch.cumprod(1 - torch.linspace(1e-4, 0.02, steps), 0).sqrt()
    first, last = root[0].clone(), root[-1].clone()
    return ((root - last) * first / (first - last)) ** 2


class X0Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x_t, t[:, None].float() / 10], -1))


def _x0_target(last_t: int) -> Scenario:
    """The dataset caches noised latents ``(x_t, eps, t)``; the loop rebuilds the x0 target
    ``(x_t - sqrt(1 - a) eps) / sqrt(a)``. Step 1 drew ``t = T`` (``randint(0, T + 1)``, an off-by-one): ``a`` is 0,
    the target ``0 / 0`` before any watched code ran. The twin draws below T."""
    torch.manual_seed(0)
    alpha_bar = _terminal_schedule(10)
    model = X0Denoiser()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x0s, eps = _batches(4, 4), _batches(4, 4)
    ts = [torch.tensor([3, 7, 5, 1]), torch.tensor([2, last_t, 6, 1]), torch.tensor([4, 0, 7, 2]),
          torch.tensor([1, 5, 8, 3])]
    cached = [(alpha_bar[t][:, None].sqrt() * x0 + (1 - alpha_bar[t][:, None]).sqrt() * e, e, t)
              for x0, e, t in zip(x0s, eps, ts)]

    def run() -> list[torch.Tensor]:
        losses = []
        for x_t, noise, t in cached:
            a = alpha_bar[t][:, None]
            target = (x_t - (1 - a).sqrt() * noise) / a.sqrt()  # producer: x0 target
            loss = F.mse_loss(model(x_t, t), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a GCN's normalised adjacency built in a collate_fn
class DenseGCN(nn.Module):
    """Two graph convolutions ``relu(A_hat X W)`` over a dense normalised adjacency the loader builds."""

    def __init__(self) -> None:
        super().__init__()
        self.convs, self.head = nn.ModuleList([nn.Linear(3, 8), nn.Linear(8, 8)]), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.relu(adjacency @ conv(x))
        return self.head(x.mean(0))


def _gcn_collate(self_loops: bool) -> Scenario:
    """Each sample is a graph; the ``collate_fn`` builds Kipf's ``D^-1/2 A D^-1/2`` without the self-loops: step 2's
    graph has an isolated node, its degree is 0 and ``0 ** -0.5`` is inf (its row and column NaN once multiplied).
    The twin adds the self-loops ``A + I``, as Kipf and Welling do."""
    torch.manual_seed(0)
    graphs = []
    for step in range(4):
        adjacency = (torch.rand(5, 5) > 0.4).float().triu(1)
        adjacency = adjacency + adjacency.T
        adjacency[0, 1] = adjacency[1, 0] = 1.0
        if step == 2:
            adjacency[4, :] = adjacency[:, 4] = 0.0  # a lone node
        else:
            adjacency[3, 4] = adjacency[4, 3] = 1.0
        graphs.append((torch.randn(5, 3), adjacency, torch.randn(1)))

    def collate(samples):
        x, adjacency, y = samples[0]
        if self_loops:
            adjacency = adjacency + torch.eye(adjacency.shape[0])
        scale = adjacency.sum(1) ** -0.5  # producer: gcn degree scale
        return x, scale[:, None] * adjacency * scale[None, :], y

    loader = torch.utils.data.DataLoader(graphs, batch_size=1, collate_fn=collate)
    model = DenseGCN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> list[torch.Tensor]:
        losses = []
        for x, adjacency, y in loader:
            loss = F.mse_loss(model(x, adjacency), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a GAN's discriminator step in a Lightning-like module
class LitGAN(nn.Module):
    """A LightningModule's shape with two optimizers: the losses live in ``discriminator_step`` and
    ``generator_step``; the slip writes the minimax discriminator loss with ``log(1 - D(G(z)))`` of probabilities."""

    def __init__(self, stable: bool) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4))
        self.discriminator, self.stable = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), stable

    def discriminator_step(self, real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        real_logit, fake_logit = self.discriminator(real), self.discriminator(self.generator(noise).detach())
        if self.stable:
            return (F.binary_cross_entropy_with_logits(real_logit, torch.ones_like(real_logit))
                    + F.binary_cross_entropy_with_logits(fake_logit, torch.zeros_like(fake_logit)))
        d_real, d_fake = torch.sigmoid(real_logit), torch.sigmoid(fake_logit)
        return -(torch.log(d_real) + torch.log(1 - d_fake)).mean()  # producer: gan discriminator log

    def generator_step(self, noise: torch.Tensor) -> torch.Tensor:
        logit = self.discriminator(self.generator(noise))
        return F.binary_cross_entropy_with_logits(logit, torch.ones_like(logit))


def _lit_gan(stable: bool) -> Scenario:
    """Step 1's noise holds a spike of 1000: the generator's sample is far off and the discriminator's logit for it
    is past 17, its sigmoid rounds to 1 and ``log(1 - 1)`` is -inf, in the discriminator's step. The twin takes
    ``binary_cross_entropy_with_logits``."""
    torch.manual_seed(0)
    gan = LitGAN(stable)
    opt_d = torch.optim.SGD(gan.discriminator.parameters(), lr=1e-4)
    opt_g = torch.optim.SGD(gan.generator.parameters(), lr=1e-4)
    reals, noises = _batches(4, 4), _batches(4, 3)
    noises[1][2] = torch.tensor([-1000.0, 1000.0, -1000.0])

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            d_loss = gan.discriminator_step(reals[step], noises[step])
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = gan.generator_step(noises[step])
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            losses += [d_loss.detach(), g_loss.detach()]
        return losses
    return Scenario((gan, opt_d, opt_g), run)


# ---------------------------------------------------------------- a masked policy's logits read by a second model
class LegalMovePolicy(nn.Module):
    """An AlphaZero-style policy head: illegal moves masked with ``-inf`` (a deliberate infinity, benign)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, board: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.net(board).masked_fill(~legal, -math.inf)


class SearchPrior(nn.Module):
    """A second watched model that turns the policy's logits into the search's prior and scores it."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Linear(5, 1)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        prior = torch.softmax(logits, -1)  # producer: search prior
        return self.value(prior)


def _search_prior(guarded: bool) -> Scenario:
    """Step 2's batch holds a terminal position: no move is legal, its row of logits is all ``-inf`` and the second
    model's softmax over it is NaN. The policy's -inf is benign at its own output; the search prior that reads it is
    the producer. The twin leaves a pass move always legal, as Go engines do."""
    torch.manual_seed(0)
    policy, search = LegalMovePolicy(), SearchPrior()
    opt = torch.optim.SGD([*policy.parameters(), *search.parameters()], lr=0.01)
    boards, targets = _batches(4, 6), _batches(4, 1)
    legal = [torch.rand(4, 5) > 0.3 for _ in range(4)]
    for mask in legal:
        mask[:, 4] = True
    legal[2][1] = False
    if guarded:
        legal[2][1, 4] = True

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(search(policy(boards[step], legal[step])), targets[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((policy, search, opt), run)


CASES = [
    Case("hunt_s28b_ppo_update_remasks_a_stale_action_kl_penalty", lambda: _ppo_mask(False),
         # The -inf of the masked logits is deliberate (benign) while log_softmax keeps it where it was; the gather
         # that picks it as an action's log-probability is where it becomes the value the loss reads.
         Expect("forward", None, step=2, op="aten.gather.default", marker="ppo stale action",
                cause="masked-softmax")),
    Case("hunt_s28b_ppo_update_uses_the_rollout_mask_healthy", lambda: _ppo_mask(True), None),
    Case("hunt_s28b_poincare_riemannian_sgd_expmap_of_an_isolated_node", lambda: _poincare_rsgd(0.0),
         Expect("optimizer", "nodes", "Embedding", step=0, op="aten.div.Tensor", marker="expmap direction")),
    Case("hunt_s28b_poincare_riemannian_sgd_norm_clamped_healthy", lambda: _poincare_rsgd(1e-15), None),
    Case("hunt_s28b_diffusion_loop_x0_target_at_t_equals_T", lambda: _x0_target(9),
         # The target is built from the cached latent, its noise and the schedule alone, before the model is called:
         # data (PRODUCT.md: phase).
         Expect("data", None, step=1, op="aten.div.Tensor", marker="x0 target", cause="division-by-zero")),
    Case("hunt_s28b_diffusion_loop_x0_target_below_T_healthy", lambda: _x0_target(8), None),
    Case("hunt_s28b_gcn_collate_normalised_adjacency_of_an_isolated_node", lambda: _gcn_collate(False),
         Expect("data", "", "DenseGCN", step=2, op="aten.pow.Tensor_Scalar", marker="gcn degree scale",
                cause="pow-domain")),
    Case("hunt_s28b_gcn_collate_self_loops_healthy", lambda: _gcn_collate(True), None),
    Case("hunt_s28b_gan_discriminator_step_log_of_1_minus_a_certain_fake", lambda: _lit_gan(False),
         Expect("forward", None, step=1, op="aten.log.default", marker="gan discriminator log", cause="log-domain")),
    Case("hunt_s28b_gan_discriminator_step_bce_with_logits_healthy", lambda: _lit_gan(True), None),
    Case("hunt_s28b_masked_policy_logits_read_by_a_second_model_terminal_position", lambda: _search_prior(False),
         Expect("forward", "", "SearchPrior", step=2, op="aten._softmax.default", marker="search prior",
                cause="masked-softmax")),
    Case("hunt_s28b_masked_policy_logits_pass_move_always_legal_healthy", lambda: _search_prior(True), None),
]
