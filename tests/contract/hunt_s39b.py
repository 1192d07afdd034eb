"""hunt_s39b, incidents whose loop is shaped unlike ``sgd_loop``: the step must still be the optimizer step it was.

GradNorm's loss ratios ``L_i / L_i(0)`` where an auxiliary task's first loss is exactly 0 (the loop's own code,
under no optimizer); a normalisation written by hand whose unbiased ``var`` meets the DataLoader's last batch of one
sample; log-transformed count features whose missing values are coded -1 (``log1p(-1)``), in a step accumulated over
three micro-batches (three forwards per step); a Siamese contrastive loss whose distance is ``sqrt`` of a sum of
squares over a duplicate pair (two forwards per step; ``sqrt``'s backward at 0); normalised gradient descent by hand
(``torch.autograd.grad`` and ``p.sub_``, no optimizer) over a head whose loss term is switched off for a batch;
and the Newton-Schulz optimizer run inside the backward (``register_post_accumulate_grad_hook``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from contract import Case, Expect, Scenario
from contract import hunt_s39 as _first
from contract.hunt_s39 import AuxNet, NewtonSchulz
from contract.loops import batches as _batches


# ---------------------------------------------------------------- GradNorm's ratio to a first loss of 0
class TwoHeads(nn.Module):
    """A classifier and a regression head; the regression head zero-initialised, so its first output is exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.cls, self.reg = nn.Linear(16, 3), nn.Linear(16, 1)
        nn.init.zeros_(self.reg.weight)
        nn.init.zeros_(self.reg.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.cls(h), self.reg(h)


def _gradnorm(floor: float) -> Scenario:
    """Task weights by GradNorm's inverse training rate ``r_i = L_i / L_i(0)``, normalised to mean 1. The first batch's
    regression targets are all 0 (an unset quantity the data pipeline filled with 0), so the regression loss at step 0
    is ``mse(0, 0) = 0``, and ``L(0) / L(0)`` is ``0 / 0``. The twin floors the first losses at 1e-8."""
    torch.manual_seed(0)
    model = TwoHeads()
    xs, ys, zs = _batches(6, 6), [torch.randint(0, 3, (6,)) for _ in range(4)], _batches(6, 1)
    zs[0].zero_()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def run() -> list[torch.Tensor]:
        out, first = [], None
        for step in range(4):
            logits, reg = model(xs[step])
            losses = torch.stack([F.cross_entropy(logits, ys[step]), F.mse_loss(reg, zs[step])])
            if first is None:
                first = losses.detach().clamp_min(floor)
            ratios = losses.detach() / first  # producer: gradnorm ratio
            loss = (ratios / ratios.mean() * losses).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a hand-written BatchNorm over a last batch of one
class HandBatchNorm(nn.Module):
    """Batch normalisation written out: the batch's mean and (unbiased) variance, running statistics kept by hand."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.register_buffer("running_mean", torch.zeros(d))
        self.register_buffer("running_var", torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            mean, var = x.mean(0), x.var(0)  # producer: hand bn var
            with torch.no_grad():
                self.running_mean.lerp_(mean, 0.1)
                self.running_var.lerp_(var, 0.1)
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


def _hand_bn(drop_last: bool) -> Scenario:
    """Nine samples in batches of 4 (``drop_last=False``, the default): step 2 is a batch of one sample, whose unbiased
    variance is ``0 / 0``. The twin passes ``drop_last=True``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), HandBatchNorm(8), nn.ReLU(), nn.Linear(8, 2))
    data = TensorDataset(torch.randn(9, 5), torch.randint(0, 2, (9,)))
    loader = DataLoader(data, batch_size=4, drop_last=drop_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> list[torch.Tensor]:
        losses = []
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- log1p of a count coded -1 for "missing"
class CountFeatures(nn.Module):
    """Two count columns, log-transformed, and three continuous ones."""

    def __init__(self, missing_as_zero: bool) -> None:
        super().__init__()
        self.net, self.missing_as_zero = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 2)), missing_as_zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = x[:, :2].clamp_min(0) if self.missing_as_zero else x[:, :2]
        return self.net(torch.cat([counts.log1p(), x[:, 2:]], 1))  # producer: log1p counts


def _micro_batches(missing_as_zero: bool) -> Scenario:
    """Each optimizer step accumulates three micro-batches (three forwards, three backwards). Step 2's second
    micro-batch holds a row whose count is -1, the export's code for "missing": ``log1p(-1)`` is ``-inf``. The twin
    maps missing counts to 0 first."""
    torch.manual_seed(0)
    model = CountFeatures(missing_as_zero)
    xs = [torch.cat([torch.randint(0, 50, (9, 2)).float(), torch.randn(9, 3)], 1) for _ in range(4)]
    xs[2][4, 1] = -1.0
    ys = [torch.randint(0, 2, (9,)) for _ in range(4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            opt.zero_grad()
            for x, y in zip(xs[step].chunk(3), ys[step].chunk(3)):
                loss = F.cross_entropy(model(x), y) / 3
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a Siamese distance over a duplicate pair
def _siamese(pairwise: bool) -> Scenario:
    """Hadsell et al.'s contrastive loss over ``d = sqrt(sum((e1 - e2)^2))``, the encoder called once per side. Step 2
    holds a pair of the same image (a duplicate in the dataset), labelled similar: ``d`` is exactly 0, and ``sqrt``'s
    backward is ``0 / 0``. The twin uses ``F.pairwise_distance`` (its eps keeps the distance above 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    lefts, rights = _batches(4, 6), _batches(4, 6)
    rights[2][1] = lefts[2][1]
    same = [torch.randint(0, 2, (4,)).float() for _ in range(4)]
    same[2][1] = 1.0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            e1, e2 = model(lefts[step]), model(rights[step])
            d = F.pairwise_distance(e1, e2) if pairwise else (e1 - e2).pow(2).sum(1).sqrt()  # producer: siamese sqrt
            y = same[step]
            loss = (y * d.pow(2) + (1 - y) * F.relu(1.0 - d).pow(2)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- normalised gradient descent by hand
def _normalised_gd(eps: float) -> Scenario:
    """No optimizer: ``torch.autograd.grad`` and ``p.sub_(lr * g / g.norm())``. Step 2's batch has no auxiliary labels,
    so its term is weighted 0 and the auxiliary head's gradient is exactly 0: ``0 / |0|``. The twin adds an eps."""
    torch.manual_seed(0)
    model = AuxNet()
    xs, ys, auxs = _batches(8, 6), [torch.randint(0, 3, (8,)) for _ in range(4)], _batches(8, 2)
    has_aux = [1.0, 1.0, 0.0, 1.0]

    def run() -> list[torch.Tensor]:
        losses = []
        params = list(model.parameters())
        for step in range(4):
            main, aux = model(xs[step])
            loss = F.cross_entropy(main, ys[step]) + has_aux[step] * F.mse_loss(aux, auxs[step])
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.sub_(0.01 * g / (g.norm() + eps))  # producer: normalised gd
            losses.append(loss.detach())
        return losses

    return Scenario((model,), run)


# ---------------------------------------------------------------- the optimizer run inside the backward
def _in_backward(eps: float) -> Scenario:
    """One Newton-Schulz optimizer per matrix, stepped by ``register_post_accumulate_grad_hook`` as each gradient is
    ready (the optimizer-in-backward recipe); AdamW for the biases after the backward. The auxiliary loss warms up
    from 0: at step 0 the auxiliary head's gradient is exactly 0, ``0 / |0|``. The twin adds Muon's eps."""
    torch.manual_seed(0)
    model = AuxNet()
    per_param = {p: NewtonSchulz([p], eps=eps) for p in model.parameters() if p.ndim == 2}
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=1e-3)

    def hook(p: torch.Tensor) -> None:
        per_param[p].step()
        per_param[p].zero_grad()

    for p in per_param:
        p.register_post_accumulate_grad_hook(hook)
    xs, ys, auxs = _batches(8, 6), [torch.randint(0, 3, (8,)) for _ in range(4)], _batches(8, 2)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            main, aux = model(xs[step])
            loss = F.cross_entropy(main, ys[step]) + min(1.0, step / 2) * F.mse_loss(aux, auxs[step])
            adamw.zero_grad()
            loss.backward()
            adamw.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, adamw, *per_param.values()), run)


#: Deferred, the check of the step runs after the backward, when the hook's ``zero_grad()`` has already dropped the
#: gradient the step read: the replay of the step (from its momentum, 0, and no gradient) stays finite.
_IN_BACKWARD_DEFER = ("defer=True names aux.weight, the optimizer phase and step 0, and the hook's line that called "
                      "step(), but no op and no cause ('unclassified': a replay of the step stayed finite): the hook's "
                      "zero_grad() dropped the gradient before the deferred check could replay the step")

CASES = [
    Case("hunt_s39b_gradnorm_ratio_to_a_first_loss_of_zero", lambda: _gradnorm(0.0),
         Expect("forward", None, step=0, op="aten.div.Tensor", marker="gradnorm ratio")),
    Case("hunt_s39b_gradnorm_ratio_floored_healthy", lambda: _gradnorm(1e-8), None),
    Case("hunt_s39b_hand_batchnorm_over_a_last_batch_of_one", lambda: _hand_bn(False),
         Expect("forward", "1", "HandBatchNorm", step=2, op="aten.var.correction", marker="hand bn var")),
    Case("hunt_s39b_hand_batchnorm_drop_last_healthy", lambda: _hand_bn(True), None),
    Case("hunt_s39b_log1p_of_a_missing_count_in_a_micro_batch", lambda: _micro_batches(False),
         Expect("forward", "", "CountFeatures", step=2, op="aten.log1p.default", marker="log1p counts")),
    Case("hunt_s39b_log1p_of_counts_missing_as_zero_healthy", lambda: _micro_batches(True), None),
    Case("hunt_s39b_siamese_sqrt_distance_of_a_duplicate_pair", lambda: _siamese(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="siamese sqrt", cause="sqrt-domain")),
    Case("hunt_s39b_siamese_pairwise_distance_healthy", lambda: _siamese(True), None),
    Case("hunt_s39b_normalised_gradient_descent_by_hand_over_a_zero_gradient", lambda: _normalised_gd(0.0),
         Expect("optimizer", "aux", "Linear", step=2, op="aten.div.Tensor", marker="normalised gd")),
    Case("hunt_s39b_normalised_gradient_descent_with_eps_healthy", lambda: _normalised_gd(1e-8), None),
    Case("hunt_s39b_newton_schulz_in_backward_over_a_zero_gradient", lambda: _in_backward(0.0),
         Expect("optimizer", "aux", "Linear", step=0, op="aten.div.Tensor", marker="newton schulz",
                op_modes=("default", "full", "ops")),
         source=_first, note=_IN_BACKWARD_DEFER),
    Case("hunt_s39b_newton_schulz_in_backward_with_eps_healthy", lambda: _in_backward(1e-7), None),
]
