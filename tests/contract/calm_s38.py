"""calm_s38, healthy training and inference that must stay silent and bit-identical in every mode (session 38).

Losses torch makes finite where a hand-written form would not: CTC with ``reduction="mean"`` over an empty transcript
(torch divides by the target length clamped to 1); ``F.binary_cross_entropy`` of a sigmoid saturated to exactly 0 and 1
(torch clamps the log at -100); ``F.poisson_nll_loss(log_input=False)`` of a rate of exactly 0 (its eps); a PPO ratio
of an old action the mask now forbids (``exp(-inf) = 0``, clipped); ``torch.linalg.vector_norm`` of all-zero rows in
the backward (torch masks ``grad / 0``). Modules and optimizers rarely seen: ``nn.AdaptiveLogSoftmaxWithLoss``,
``ASGD``, ``Adadelta``, ``Rprop``, ``NAdam`` with decoupled weight decay, schedulers chained by ``SequentialLR``
(linear warm-up from 1e-3 of the lr, then cosine), param groups with a frozen group under weight decay, and an
``nn.TransformerEncoder`` evaluated under ``no_grad`` in eval mode (its nested-tensor fast path over padded batches)
inside the training loop. Distributions rarely seen: a mixture density network whose mixture logits switch components
off with ``-inf``, ``ContinuousBernoulli`` of saturated logits, ``VonMises`` with a large concentration.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributions import Categorical
from torch.nn import functional as F

from contract import Case, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


def _mlp(d_in: int = 6, d_out: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out))


# ---------------------------------------------------------------- losses torch keeps finite
def _ctc_empty_transcript() -> Scenario:
    """An ASR batch whose second clip is silence, transcribed as the empty string (target length 0)."""
    torch.manual_seed(0)
    model = _mlp(5, 6)
    xs = _batches(8, 2, 5)
    targets = torch.tensor([[1, 2, 3], [0, 0, 0]])
    target_lengths = torch.tensor([3, 0])

    def loss(out: torch.Tensor, step: int) -> torch.Tensor:
        log_probs = out.log_softmax(-1)
        return F.ctc_loss(log_probs, targets, torch.tensor([8, 8]), target_lengths, blank=0)

    return _loop(model, lambda step: (xs[step],), loss)


def _bce_saturated() -> Scenario:
    """``F.binary_cross_entropy(sigmoid(z), y)`` with a logit of -200 and one of +200 (the sigmoid is exactly 0 and 1),
    both of the wrong label: torch clamps each log at -100, forward and backward."""
    torch.manual_seed(0)
    model = _mlp(6, 1)
    xs = _batches(4, 6)
    ys = [torch.randint(0, 2, (4, 1)).float() for _ in range(4)]
    ys[2][0], ys[2][1] = 1.0, 0.0

    def loss(out: torch.Tensor, step: int) -> torch.Tensor:
        z = out + torch.tensor([[-200.0], [200.0], [0.0], [0.0]]) * (step == 2)
        return F.binary_cross_entropy(torch.sigmoid(z), ys[step])

    return _loop(model, lambda step: (xs[step],), loss)


def _poisson_zero_rate() -> Scenario:
    """A count model whose rate is ``relu(out)``: exactly 0 for some samples, taken by ``F.poisson_nll_loss(
    log_input=False)``, whose ``log(input + eps)`` stays finite."""
    torch.manual_seed(0)
    model = _mlp(6, 1)
    xs = _batches(6, 6)
    counts = [torch.randint(0, 4, (6, 1)).float() for _ in range(4)]
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: F.poisson_nll_loss(F.relu(out), counts[step], log_input=False))


def _ppo_masked_old_action() -> Scenario:
    """PPO's clipped ratio ``exp(log_prob(old_action) - old_log_prob)``; at step 2 an old action is illegal under the
    current mask: its log-probability is ``-inf``, the ratio 0 (clipped to 0.8), its gradient 0."""
    torch.manual_seed(0)
    model = _mlp(6, 4)
    xs = _batches(4, 6)
    legal = [torch.ones(4, 4, dtype=torch.bool) for _ in range(4)]
    legal[2][1, 2] = False
    actions = [torch.tensor([0, 2, 1, 3]) for _ in range(4)]
    old_log_probs = [torch.full((4,), -1.3) for _ in range(4)]
    advantages = [torch.randn(4) for _ in range(4)]

    def loss(logits: torch.Tensor, step: int) -> torch.Tensor:
        dist = Categorical(logits=logits.masked_fill(~legal[step], float("-inf")))
        ratio = torch.exp(dist.log_prob(actions[step]) - old_log_probs[step])
        surrogate = torch.min(ratio * advantages[step], ratio.clamp(0.8, 1.2) * advantages[step])
        return -surrogate.mean() - 0.01 * dist.entropy().mean()

    return _loop(model, lambda step: (xs[step],), loss)


def _norm_of_zero_rows() -> Scenario:
    """Mean-pooled padded token embeddings regularised by ``torch.linalg.vector_norm(emb, dim=-1)``; the padding row
    (``padding_idx=0``) is exactly 0, and torch's norm backward masks its ``grad / 0``."""
    torch.manual_seed(0)
    embed = nn.Embedding(10, 6, padding_idx=0)
    model = nn.ModuleDict({"embed": embed, "head": nn.Linear(6, 2)})
    ids = [torch.randint(1, 10, (3, 5)) for _ in range(4)]
    for t in ids:
        t[:, 3:] = 0
    ys = [torch.randint(0, 2, (3,)) for _ in range(4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            emb = model["embed"](ids[step])
            loss = F.cross_entropy(model["head"](emb.mean(1)), ys[step])
            loss = loss + 0.01 * torch.linalg.vector_norm(emb, dim=-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- modules and optimizers rarely seen
def _adaptive_softmax() -> Scenario:
    """A language-model head by ``nn.AdaptiveLogSoftmaxWithLoss`` (a head and two tail clusters), its loss its own."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Embedding(40, 8), nn.Flatten(), nn.Linear(24, 8))
    head = nn.AdaptiveLogSoftmaxWithLoss(8, 40, cutoffs=[8, 20], div_value=2.0)
    model = nn.ModuleDict({"body": body, "head": head})
    ctx = [torch.randint(0, 40, (6, 3)) for _ in range(4)]
    nxt = [torch.randint(0, 40, (6,)) for _ in range(4)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = model["head"](model["body"](ctx[step]), nxt[step]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _with_optimizer(make) -> Scenario:
    torch.manual_seed(0)
    model = _mlp()
    xs, ys = _batches(5, 6), [torch.randint(0, 3, (5,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]),
                 opt=make(model.parameters()))


def _sequential_lr() -> Scenario:
    """AdamW with ``SequentialLR([LinearLR(start_factor=1e-3), CosineAnnealingLR])``."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-3, total_iters=2),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)], milestones=[2])
    xs, ys = _batches(5, 6, steps=5), [torch.randint(0, 3, (5,)) for _ in range(5)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(5):
            loss = F.cross_entropy(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _frozen_group() -> Scenario:
    """Fine-tuning with param groups: a frozen backbone (``requires_grad=False``, its grads None) under AdamW's weight
    decay in its own group with lr 0, the head at 1e-2."""
    torch.manual_seed(0)
    backbone, head = nn.Sequential(nn.Linear(6, 16), nn.ReLU()), nn.Linear(16, 3)
    backbone.requires_grad_(False)
    model = nn.Sequential(backbone, head)
    opt = torch.optim.AdamW([{"params": backbone.parameters(), "lr": 0.0, "weight_decay": 0.1},
                             {"params": head.parameters(), "lr": 1e-2}])
    xs, ys = _batches(5, 6), [torch.randint(0, 3, (5,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]), opt=opt)


def _encoder_eval_inside_training() -> Scenario:
    """A sequence classifier on ``nn.TransformerEncoder``; every other step the loop evaluates it in eval mode under
    ``torch.no_grad()`` on a padded batch (``src_key_padding_mask``), the nested-tensor fast path, then trains on."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    model = nn.ModuleDict({"encoder": encoder, "head": nn.Linear(8, 2)})
    xs, ys = _batches(3, 5, 8), [torch.randint(0, 2, (3,)) for _ in range(4)]
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True
    pad[2, 1:] = True
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> list[torch.Tensor]:
        out = []
        for step in range(4):
            model.train()
            loss = F.cross_entropy(model["head"](model["encoder"](xs[step]).mean(1)), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
            if step % 2 == 1:
                model.eval()
                with torch.no_grad():
                    h = model["encoder"](xs[step], src_key_padding_mask=pad)
                    out.append(model["head"](h.masked_fill(pad[..., None], 0.0).sum(1)))
        model.train()
        return out

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- distributions rarely seen
def _mdn_masked_components() -> Scenario:
    """A mixture density network, ``MixtureSameFamily(Categorical(logits=pi), Normal(mu, sigma))``, with 2 of its 5
    components switched off for some samples by ``-inf`` mixture logits (a curriculum grows the mixture)."""
    torch.manual_seed(0)
    model = _mlp(4, 15)
    xs, ys = _batches(6, 4), _batches(6)
    active = torch.ones(6, 5, dtype=torch.bool)
    active[::2, 3:] = False

    def nll(out: torch.Tensor, step: int) -> torch.Tensor:
        pi, mu, log_sigma = out.chunk(3, -1)
        mixture = torch.distributions.MixtureSameFamily(
            Categorical(logits=pi.masked_fill(~active, float("-inf"))),
            torch.distributions.Normal(mu, F.softplus(log_sigma) + 1e-3))
        return -mixture.log_prob(ys[step]).mean()

    return _loop(model, lambda step: (xs[step],), nll, lr=1e-3)


def _continuous_bernoulli() -> Scenario:
    """A VAE decoder's likelihood by ``ContinuousBernoulli(logits=...)`` over pixels in [0, 1], some logits saturated
    at +-60 (torch clamps the probabilities and expands the normaliser near 1/2)."""
    torch.manual_seed(0)
    model = _mlp(6, 8)
    xs = _batches(4, 6)
    pixels = [torch.rand(4, 8) for _ in range(4)]
    push = torch.zeros(4, 8)
    push[0, :2], push[1, 2:4] = 60.0, -60.0

    def nll(out: torch.Tensor, step: int) -> torch.Tensor:
        dist = torch.distributions.ContinuousBernoulli(logits=out + push)
        return -dist.log_prob(pixels[step]).sum(-1).mean()

    return _loop(model, lambda step: (xs[step],), nll, lr=1e-3)


def _von_mises() -> Scenario:
    """Wind direction regression by ``VonMises(loc, concentration)``, the concentration by ``softplus`` (large for
    confident samples: torch's ``i0e`` keeps its normaliser finite)."""
    torch.manual_seed(0)
    model = _mlp(6, 2)
    xs = _batches(6, 6)
    angles = [torch.rand(6) * 6.28 - 3.14 for _ in range(4)]

    def nll(out: torch.Tensor, step: int) -> torch.Tensor:
        dist = torch.distributions.VonMises(out[:, 0], F.softplus(out[:, 1] * 50.0) + 1e-3)
        return -dist.log_prob(angles[step]).mean()

    return _loop(model, lambda step: (xs[step],), nll, lr=1e-3)


CASES = [
    Case("calm_s38_ctc_mean_over_an_empty_transcript", _ctc_empty_transcript, None),
    Case("calm_s38_bce_of_a_sigmoid_saturated_to_exactly_0_and_1", _bce_saturated, None),
    Case("calm_s38_poisson_nll_of_a_rate_of_exactly_0", _poisson_zero_rate, None),
    Case("calm_s38_ppo_ratio_of_an_old_action_now_masked", _ppo_masked_old_action, None),
    Case("calm_s38_vector_norm_of_zero_padding_rows_backward", _norm_of_zero_rows, None),
    Case("calm_s38_adaptive_log_softmax_with_loss", _adaptive_softmax, None),
    Case("calm_s38_asgd", lambda: _with_optimizer(lambda p: torch.optim.ASGD(p, lr=0.05, t0=1)), None),
    Case("calm_s38_adadelta", lambda: _with_optimizer(lambda p: torch.optim.Adadelta(p, lr=1.0)), None),
    Case("calm_s38_rprop", lambda: _with_optimizer(lambda p: torch.optim.Rprop(p, lr=0.01)), None),
    Case("calm_s38_nadam_decoupled_weight_decay",
         lambda: _with_optimizer(lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.1,
                                                             decoupled_weight_decay=True)), None),
    Case("calm_s38_sequential_lr_linear_warmup_then_cosine", _sequential_lr, None),
    Case("calm_s38_frozen_param_group_under_weight_decay", _frozen_group, None),
    Case("calm_s38_transformer_encoder_fast_path_eval_inside_training", _encoder_eval_inside_training, None),
    Case("calm_s38_mixture_density_with_components_masked_by_minus_inf", _mdn_masked_components, None),
    Case("calm_s38_continuous_bernoulli_of_saturated_logits", _continuous_bernoulli, None),
    Case("calm_s38_von_mises_with_a_large_concentration", _von_mises, None),
]
