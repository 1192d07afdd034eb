"""hunt_s31b, more incident families the contract had not seen, each with its healthy twin.

A neural Hawkes process whose base rate is a ReLU (the first event of a sequence has no history: ``log(0)`` of its
intensity, computed in the model's own forward); evidential regression (a Normal-Inverse-Gamma head) whose ``nu``
``softplus`` underflows to 0 on an outlier, ``pi / nu``; GradNorm's inverse training rates ``L(t) / L(0)`` over an
auxiliary task whose first batch had no label (its initial loss 0). Each twin applies its users' fix and must stay
silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- a Hawkes process with a ReLU base rate
class HawkesTPP(nn.Module):
    """Self-exciting point process: ``lambda(t) = mu(x) + sum_j a exp(-b (t - t_j))``, ``mu`` from the covariates;
    the forward returns the negative log-likelihood of each sequence's event times over ``[0, T]``."""

    def __init__(self, smooth: bool) -> None:
        super().__init__()
        self.base, self.smooth = nn.Linear(3, 1), smooth
        self.log_alpha, self.log_beta = nn.Parameter(torch.tensor(-1.0)), nn.Parameter(torch.tensor(0.0))
        with torch.no_grad():
            self.base.bias.fill_(0.5)

    def forward(self, x: torch.Tensor, times: torch.Tensor, horizon: float) -> torch.Tensor:
        raw = self.base(x).squeeze(-1)
        mu = F.softplus(raw) if self.smooth else torch.relu(raw)
        alpha, beta = self.log_alpha.exp(), self.log_beta.exp()
        gaps = (times[:, :, None] - times[:, None, :]).clamp(min=0)
        earlier = torch.ones(times.shape[1], times.shape[1]).tril(-1)
        excitation = (alpha * torch.exp(-beta * gaps) * earlier).sum(-1)
        log_intensity = torch.log(mu[:, None] + excitation)  # producer: hawkes log
        compensator = mu * horizon + alpha / beta * (1 - torch.exp(-beta * (horizon - times))).sum(-1)
        return compensator - log_intensity.sum(-1)


def _hawkes(smooth: bool) -> Scenario:
    """Customers' purchase times over 10 days, the base rate from three covariates; step 2's batch holds a customer
    whose covariates drive the ReLU's input negative: its base rate is 0 and its first purchase, with no earlier one
    to excite it, has intensity 0. The twin's base rate is ``softplus``, as the neural Hawkes process has it."""
    torch.manual_seed(0)
    model = HawkesTPP(smooth)
    xs = [torch.randn(4, 3) * 0.1 for _ in range(4)]
    xs[2][1] = -20.0 * model.base.weight.detach()[0].sign()
    times = [torch.rand(4, 5).sort(-1).values * 10 for _ in range(4)]
    return _loop(model, lambda step: (xs[step], times[step], 10.0), lambda out, step: out.mean())


# ---------------------------------------------------------------- evidential regression: nu underflows to 0
class NIGHead(nn.Module):
    """Deep evidential regression (Amini et al.): a Normal-Inverse-Gamma ``(gamma, nu, alpha, beta)`` per sample."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.body, self.out, self.eps = nn.Linear(4, 16), nn.Linear(16, 4), eps
        self.skip = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        gamma, nu, alpha, beta = self.out(torch.tanh(self.body(x))).unbind(-1)
        nu = nu + self.skip(x).squeeze(-1)  # the evidence also reads the raw reading, as a skip connection
        return gamma, F.softplus(nu) + self.eps, F.softplus(alpha) + 1.0, F.softplus(beta) + self.eps


def _nig_nll(out: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
    gamma, nu, alpha, beta = out
    omega = 2 * beta * (1 + nu)
    nll = (0.5 * torch.log(math.pi / nu)  # producer: nig nu
           - alpha * torch.log(omega) + (alpha + 0.5) * torch.log(nu * (y - gamma) ** 2 + omega)
           + torch.lgamma(alpha) - torch.lgamma(alpha + 0.5))
    return nll.mean()


def _evidential_regression(eps: float) -> Scenario:
    """Step 2's batch holds a reading 200 times out of range (a unit slip): the skip connection drives ``nu``'s
    logit below -104, ``softplus`` underflows to exactly 0 and ``pi / 0`` is inf (torch takes ``reciprocal``). The
    twin adds 1e-6 to the positive heads, as the evidential regression code does."""
    torch.manual_seed(0)
    model = NIGHead(eps)
    xs, ys = _batches(4, 4), _batches(4)
    xs[2][3] = -200.0 * model.skip.weight.detach()[0].sign()
    return _loop(model, lambda step: (xs[step],), lambda out, step: _nig_nll(out, ys[step]))


# ---------------------------------------------------------------- GradNorm over a task whose first loss was 0
class TwoTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.depth, self.seg = nn.Linear(4, 16), nn.Linear(16, 1), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.trunk(x))
        return self.depth(h).squeeze(-1), self.seg(h).squeeze(-1)


def _gradnorm(floor: float) -> Scenario:
    """GradNorm (Chen et al.): task weights ``w`` learned so each task's gradient norm at the trunk follows its
    inverse training rate ``L_i(t) / L_i(0)``. The auxiliary task's labels are sparse, its loss a masked mean, and
    the first batch had none: ``L(0)`` is 0 and the rate ``0 / 0``. The balance objective the loop differentiates is
    NaN, and since torch's ``sgn(NaN)`` is 0 its gradient is 0: the weights silently stop balancing, and the losses
    stay finite. The twin floors the initial losses at 1e-3."""
    torch.manual_seed(0)
    model = TwoTask()
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([*model.parameters(), w], lr=0.01)
    xs, depths, segs = _batches(8, 4), _batches(8), _batches(8)
    masks = [torch.rand(8) < 0.5 for _ in range(4)]
    masks[0][:] = False
    initial: list[torch.Tensor] = []

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            depth, seg = model(xs[step])
            labelled = masks[step].float()
            task = torch.stack([F.mse_loss(depth, depths[step]),
                                ((seg - segs[step]) ** 2 * labelled).sum() / labelled.sum().clamp(min=1.0)])
            if step == 0:
                initial.append(task.detach().clamp(min=floor))
            weighted = w * task
            norms = torch.stack([torch.autograd.grad(weighted[i], model.trunk.weight, retain_graph=True,
                                                     create_graph=True)[0].norm() for i in range(2)])
            rate = task.detach() / initial[0]  # producer: gradnorm rate
            target = (norms.mean() * (rate / rate.mean()) ** 0.12).detach()
            balance = (norms - target).abs().sum()
            opt.zero_grad()
            weighted.sum().backward(retain_graph=True)
            w.grad = torch.autograd.grad(balance, w)[0]
            opt.step()
            with torch.no_grad():
                w.mul_(2 / w.sum())
            losses.append(weighted.detach().sum())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a pointer network's masked softmax by hand
class Pointer(nn.Module):
    """Pointer-network decoding step (a routing policy): scores over the cities, visited ones masked with -inf, and a
    softmax written by hand, ``exp(s) / sum(exp(s))`` (the max subtracted first in the twin)."""

    def __init__(self, stable: bool) -> None:
        super().__init__()
        self.query, self.key, self.stable = nn.Linear(2, 16), nn.Linear(2, 16), stable

    def forward(self, cities: torch.Tensor, visited: torch.Tensor) -> torch.Tensor:
        scores = (self.key(cities) @ self.query(cities[:, :1]).transpose(1, 2)).squeeze(-1)
        scores = scores.masked_fill(visited, float("-inf"))
        if self.stable:
            scores = scores - scores.amax(-1, keepdim=True)
        weights = torch.exp(scores)  # producer: pointer exp
        return weights / weights.sum(-1, keepdim=True)


def _pointer(stable: bool) -> Scenario:
    """REINFORCE over the next city's log-probability; step 2's instance has coordinates in metres instead of
    kilometres (x 1000): the unmasked scores reach the thousands and their ``exp`` overflows beside the mask's -inf.
    The ``exp`` of the mask is 0, its overflow is the finite scores'; the report said "unclassified: made +inf from
    inputs already non-finite" before (explain/forward.py). The twin subtracts the row max."""
    torch.manual_seed(0)
    model = Pointer(stable)
    cities = [torch.rand(2, 6, 2) for _ in range(4)]
    cities[2] = cities[2] * 1000.0
    visited = [torch.rand(2, 6) < 0.3 for _ in range(4)]
    for mask in visited:
        mask[:, 0] = True  # the depot is where the tour starts
        mask[:, 1] = False
    rewards = _batches(2)
    return _loop(model, lambda step: (cities[step], visited[step]),
                 lambda out, step: -(rewards[step] * torch.log(out[:, 1] + 1e-9)).mean())


CASES = [
    Case("hunt_s31b_pointer_network_masked_softmax_by_hand_exp_overflow", lambda: _pointer(False),
         Expect("forward", "", "Pointer", step=2, op="aten.exp.default", marker="pointer exp", cause="exp-overflow")),
    Case("hunt_s31b_pointer_network_masked_softmax_max_subtracted_healthy", lambda: _pointer(True), None),
    Case("hunt_s31b_hawkes_relu_base_rate_0_at_a_first_event", lambda: _hawkes(False),
         Expect("forward", "", "HawkesTPP", step=2, op="aten.log.default", marker="hawkes log", cause="log-domain")),
    Case("hunt_s31b_hawkes_softplus_base_rate_healthy", lambda: _hawkes(True), None),
    Case("hunt_s31b_evidential_regression_nu_softplus_underflows", lambda: _evidential_regression(0.0),
         Expect("forward", None, step=2, op="aten.reciprocal.default", marker="nig nu",
                cause="division-by-zero")),
    Case("hunt_s31b_evidential_regression_with_eps_healthy", lambda: _evidential_regression(1e-6), None),
    Case("hunt_s31b_gradnorm_rate_over_an_initial_loss_of_0", lambda: _gradnorm(0.0),
         Expect("forward", None, step=0, op="aten.div.Tensor", marker="gradnorm rate", cause="division-by-zero")),
    Case("hunt_s31b_gradnorm_initial_loss_floored_healthy", lambda: _gradnorm(1e-3), None),
]
