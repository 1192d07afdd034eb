"""hunt_s39c, incidents under torch.func and a model that returns a distribution, each with its healthy twin.

A logistic regression trained by ``torch.func.grad`` (no optimizer, parameters in a dict) with a hand-written binary
cross-entropy over an unscaled feature: the sigmoid rounds to exactly 1 and ``log(1 - p)`` is ``-inf``. DP-SGD by hand,
per-sample gradients by ``vmap(grad(...))``, clipped by Bu et al.'s automatic clipping without its stability constant
(``g / |g|``) over a sample whose hinge loss is satisfied (a gradient of exactly 0). A Gaussian policy that returns a
``torch.distributions.Normal`` (no tensor output to check at its boundary) and normalises observations by running
statistics whose std is 0 for a sensor that read 0 throughout the rollout.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributions import Normal
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches


# ---------------------------------------------------------------- torch.func.grad over a BCE written by hand
def _func_logistic(with_logits: bool) -> Scenario:
    """Step 2 holds a sample whose raw feature (an income, in currency units) puts the logit above 1000 while its
    label is 0: ``sigmoid`` is exactly 1 and ``log(1 - p)`` is ``-inf``. The twin calls
    ``binary_cross_entropy_with_logits``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    xs, ys = _batches(6, 4), [torch.randint(0, 2, (6,)).float() for _ in range(4)]
    xs[2][3] = 2000.0 * F.normalize(params["weight"][0], dim=0)
    ys[2][3] = 0.0

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = functional_call(model, p, (x,)).squeeze(-1)
        if with_logits:
            return F.binary_cross_entropy_with_logits(z, y)
        prob = torch.sigmoid(z)
        return -(y * torch.log(prob) + (1 - y) * torch.log(1 - prob)).mean()  # producer: func bce

    def run() -> list[torch.Tensor]:
        nonlocal params
        out = []
        for step in range(4):
            g = grad(loss_fn)(params, xs[step], ys[step])
            params = {k: v - 0.1 * g[k] for k, v in params.items()}
            out.append(params["weight"].clone())
        return out

    return Scenario((model,), run)


# ---------------------------------------------------------------- DP-SGD with automatic clipping over a zero gradient
def _dp_sgd(stability: float) -> Scenario:
    """A linear SVM trained by DP-SGD: per-sample gradients by ``vmap(grad(hinge))``, each normalised by its own norm
    (Bu et al.'s AUTO-V clipping), averaged, noised by a private generator. Step 2 holds a sample far on the right side
    of the margin: its hinge is 0 and its gradient exactly 0, ``0 / 0``. The twin is AUTO-S (``g / (|g| + 0.01)``)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    xs, ys = _batches(6, 5), [torch.randint(0, 2, (6,)).float() * 2 - 1 for _ in range(4)]
    xs[2][2] = 1000.0 * ys[2][2] * F.normalize(params["weight"][0], dim=0)
    noise = torch.Generator().manual_seed(7)

    def hinge(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.relu(1 - y * functional_call(model, p, (x[None],)).squeeze())

    def run() -> list[torch.Tensor]:
        nonlocal params
        out = []
        for step in range(4):
            per_sample = vmap(grad(hinge), in_dims=(None, 0, 0))(params, xs[step], ys[step])
            norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
            update = {}
            for k, g in per_sample.items():
                clipped = g / (norms + stability).view(-1, *[1] * (g.ndim - 1))  # producer: auto clip
                update[k] = clipped.mean(0) + 0.01 * torch.randn(g.shape[1:], generator=noise)
            params = {k: v - 0.05 * update[k] for k, v in params.items()}
            out.append(params["weight"].clone())
        return out

    return Scenario((model,), run)


# ---------------------------------------------------------------- a policy that returns Normal(...)
class GaussianPolicy(nn.Module):
    """Observations normalised by running statistics (buffers the loop refreshes), a Normal over actions."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("obs_mean", torch.zeros(4))
        self.register_buffer("obs_std", torch.ones(4))
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.mu = nn.Linear(16, 2)
        self.log_std = nn.Parameter(torch.full((2,), -0.5))

    def forward(self, obs: torch.Tensor) -> Normal:
        z = (obs - self.obs_mean) / (self.obs_std + self.eps)  # producer: obs norm
        return Normal(self.mu(self.body(z)), self.log_std.exp(), validate_args=False)


def _policy(eps: float) -> Scenario:
    """REINFORCE on a Gaussian policy. Before step 2 the loop refreshes the normaliser from the rollout so far: sensor 3
    read exactly 0 in every observation, so its std is 0 and ``(0 - 0) / 0`` is NaN, inside ``forward``, whose output is
    a ``Normal`` (the NaN sits in its ``loc``). The twin adds 1e-8 to the std, as Stable-Baselines does."""
    torch.manual_seed(0)
    model = GaussianPolicy(eps)
    obs = _batches(8, 4)
    for o in obs:
        o[:, 3] = 0.0
    actions, returns = _batches(8, 2), _batches(8)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                seen = torch.cat(obs[:2])
                model.obs_mean.copy_(seen.mean(0))
                model.obs_std.copy_(seen.std(0))
            dist = model(obs[step])
            loss = -(dist.log_prob(actions[step]).sum(-1) * returns[step]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


#: Known limits (strict xfails): a training step made wholly of torch.func transforms is reported one step late, at
#: the next forward (tests/test_func_steps.py holds what every mode says).
_FUNC_LATE = (
    "reported at step 3, not 2: the loss (log(1 - p) = +inf) and the gradients are made inside torch.func.grad, whose "
    "own autograd.grad (create_graph=True) is not judged as a loss backward, and there is no optimizer step; the NaN "
    "is first seen at step 3's forward, in the parameter slot functional_call filled with the loop's tensor (module "
    "None, the stand-in named), with no op (default, full, ops) or grad's backward div at the grad() line (defer)")
_DP_LATE = (
    "reported at step 3, not 2: the per-sample gradient of 0 is divided by its norm of 0 in the loop's code, between "
    "two vmap(grad(...)) steps with no backward() and no optimizer step; the NaN is first seen at step 3's forward, "
    "in the parameter slot functional_call filled with the loop's tensor (module None). ops=True names the div at its "
    "line (phase forward); defer names it as phase data; default and full name no op")

CASES = [
    Case("hunt_s39c_func_grad_hand_bce_of_a_saturated_sigmoid", lambda: _func_logistic(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="func bce", cause="log-domain"),
         marks=(pytest.mark.xfail(strict=True, reason=_FUNC_LATE),)),
    Case("hunt_s39c_func_grad_bce_with_logits_healthy", lambda: _func_logistic(True), None),
    Case("hunt_s39c_dp_sgd_automatic_clipping_of_a_zero_gradient", lambda: _dp_sgd(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="auto clip", cause="division-by-zero"),
         marks=(pytest.mark.xfail(strict=True, reason=_DP_LATE),)),
    Case("hunt_s39c_dp_sgd_automatic_clipping_with_stability_healthy", lambda: _dp_sgd(0.01), None),
    Case("hunt_s39c_policy_returning_normal_with_a_zero_observation_std", lambda: _policy(0.0),
         Expect("forward", "", "GaussianPolicy", step=2, op="aten.div.Tensor", marker="obs norm",
                cause="division-by-zero")),
    Case("hunt_s39c_policy_returning_normal_std_with_eps_healthy", lambda: _policy(1e-8), None),
]
