"""hunt_s38, incidents of families the contract had not seen, each a small training loop with its healthy twin.

Distributions and losses: a KL penalty between two ``Categorical`` policies whose illegal actions both carry ``-inf``
logits (``torch.distributions``' own formula is finite forward, but its backward is ``0 * (-inf - -inf)``), fixed by
filling ``torch.finfo.min``; behaviour cloning by ``Categorical(logits=masked).log_prob`` of a demonstrated action the
legal-action mask now forbids (``-inf`` log-likelihood); a segmentation cross-entropy with a class weight of 0 for
the void class over a crop that is all void (``0 / 0`` of the weighted mean); multi-task uncertainty weighting with the
task scales ``sigma`` initialised to 0 (``L / (2 sigma^2)``). Schedules: an inverse-square-root learning rate made with
numpy over ``np.arange(steps)`` (``0 ** -0.5`` is ``inf`` in numpy: the first SGD step writes ``-inf * grad``).
Attention: a hand-written causal attention over a left-padded batch (the pad queries see only pad keys: a fully
masked row), whose twin calls ``F.scaled_dot_product_attention`` with the same boolean mask (torch returns 0 for a
fully masked row). Counts: ``-Poisson(relu(out)).log_prob(k)`` of a shop the ReLU rate puts at exactly 0 that sold
items (``xlogy(k, 0)``). Structure: class-incremental learning whose new classifier rows, appended as zeros, the loop
renormalises in place under ``no_grad`` (the loop's code, not the optimizer, made the parameter NaN).
Precision: a float16 attention (inference, no optimizer) with HF's additive mask of ``finfo(float16).min`` over an
empty sample: ``min + score`` rounds to ``-inf`` where the score is below -16 (the twin: SDPA with the same mask).
Each twin applies its users' fix and must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, kl_divergence
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- KL between two masked Categorical policies
class MaskedPolicy(nn.Module):
    """A policy over 5 actions whose illegal actions are filled with ``fill`` (``-inf``, or ``finfo.min``)."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.net, self.fill = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5)), fill

    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.net(x).masked_fill(~legal, self.fill)


def _policy_kl(fill: float) -> Scenario:
    """A KL penalty to a frozen reference policy (``kl_divergence(Categorical(logits=new), Categorical(logits=ref))``),
    both masked by the same legal actions. Until step 2 every action is legal; step 2 holds a state with two illegal
    actions: torch's ``_kl_categorical_categorical`` computes ``p.probs * (p.logits - q.logits)`` (``0 * (-inf -
    -inf)``, NaN) and overwrites it with 0 where ``p.probs == 0``; the forward is finite, but the product's backward is
    ``0 * NaN`` into ``p.probs``, and the softmax spreads it over the row. The twin fills ``torch.finfo.min``."""
    torch.manual_seed(0)
    model, reference = MaskedPolicy(fill), MaskedPolicy(fill)
    xs = _batches(4, 6)
    legal = [torch.ones(4, 5, dtype=torch.bool) for _ in range(4)]
    legal[2][1, 3:] = False
    advantages = [torch.randn(4) for _ in range(4)]
    actions = [torch.tensor([0, 1, 2, 1]) for _ in range(4)]

    def loss(logits: torch.Tensor, step: int) -> torch.Tensor:
        with torch.no_grad():
            ref = reference(xs[step], legal[step])
        new = Categorical(logits=logits)
        pg = -(new.log_prob(actions[step]) * advantages[step]).mean()
        return pg + 0.1 * kl_divergence(new, Categorical(logits=ref)).mean()  # producer: policy kl

    return _loop(model, lambda step: (xs[step], legal[step]), loss)


# ---------------------------------------------------------------- behaviour cloning of a now-illegal action
def _cloning(mask_keeps_demo: bool) -> Scenario:
    """Behaviour cloning, ``-Categorical(logits=policy(obs, legal)).log_prob(demo_action)``. The demonstrations were
    logged under an older rule set: at step 2 a demonstrated action is one the current legal-action mask forbids, so
    its logit is ``-inf`` and its log-likelihood too. The twin keeps the demonstrated action legal."""
    torch.manual_seed(0)
    model = MaskedPolicy(float("-inf"))
    xs = _batches(4, 6)
    demos = [torch.randint(0, 5, (4,)) for _ in range(4)]
    legal = [torch.ones(4, 5, dtype=torch.bool) for _ in range(4)]
    for step in range(4):
        legal[step][:, 4] = False
        demos[step] = demos[step].clamp_max(3)
    demos[2][2] = 4
    if mask_keeps_demo:
        for step in range(4):
            legal[step][torch.arange(4), demos[step]] = True

    def loss(logits: torch.Tensor, step: int) -> torch.Tensor:
        return -Categorical(logits=logits).log_prob(demos[step]).mean()  # producer: cloning

    return _loop(model, lambda step: (xs[step], legal[step]), loss)


# ---------------------------------------------------------------- a void class of weight 0 over an all-void crop
class TinySegmenter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _void_weight(guarded: bool) -> Scenario:
    """Semantic segmentation with class weights ``[0, 1, 1, 1]`` (class 0 is 'void': unlabelled pixels). Random
    crops; step 2's crop falls wholly in an unlabelled region: every pixel is void, the weighted mean divides a sum
    of 0 by a total weight of 0. The twin sums and divides by the total weight clamped to at least 1."""
    torch.manual_seed(0)
    model = TinySegmenter()
    xs = _batches(2, 3, 6, 6)
    ys = [torch.randint(0, 4, (2, 6, 6)) for _ in range(4)]
    ys[2].zero_()
    weight = torch.tensor([0.0, 1.0, 1.0, 1.0])

    def loss(logits: torch.Tensor, step: int) -> torch.Tensor:
        if guarded:
            total = F.cross_entropy(logits, ys[step], weight=weight, reduction="sum")
            return total / weight[ys[step]].sum().clamp_min(1.0)
        return F.cross_entropy(logits, ys[step], weight=weight)  # producer: void weight

    return _loop(model, lambda step: (xs[step],), loss)


# ---------------------------------------------------------------- uncertainty weighting with sigma initialised to 0
class TwoTaskNet(nn.Module):
    """Two regression heads and Kendall et al.'s task weighting, by ``sigma`` itself or by ``log sigma^2``."""

    def __init__(self, by_log: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.heads = nn.Linear(16, 2)
        self.by_log = by_log
        self.task_scale = nn.Parameter(torch.zeros(2))  # sigma (or log sigma^2), initialised as the paper's log_vars

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_task = (self.heads(self.body(x)) - y).pow(2).mean(0)
        if self.by_log:
            return (torch.exp(-self.task_scale) * per_task + self.task_scale).sum() / 2
        sigma = self.task_scale
        return (per_task / (2 * sigma**2) + torch.log(sigma.abs() + 1)).sum()  # producer: task weighting


def _uncertainty(by_log: bool) -> Scenario:
    """The weights were initialised to zeros, as the paper's ``log sigma^2`` is, but the loss divides by ``sigma^2``
    itself: ``L / 0`` at the first step. The twin weights by ``exp(-log sigma^2)``."""
    torch.manual_seed(0)
    model = TwoTaskNet(by_log)
    xs, ys = _batches(5, 6), _batches(5, 2)
    return _loop(model, lambda step: (xs[step], ys[step]), lambda loss, step: loss, lr=1e-3)


# ---------------------------------------------------------------- an inverse-square-root schedule by numpy
def _numpy_schedule(shifted: bool) -> Scenario:
    """``lrs = 0.05 * np.arange(steps, dtype=float) ** -0.5``, set into the param group each step: numpy makes
    ``0.0 ** -0.5`` ``inf`` (with a RuntimeWarning), and the first SGD step adds ``-inf * grad`` to every weight. The
    twin counts steps from 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    xs, ys = _batches(4, 6), [torch.randint(0, 2, (4,)) for _ in range(4)]
    with np.errstate(divide="ignore"):
        lrs = 0.05 * (np.arange(4, dtype=float) + (1.0 if shifted else 0.0)) ** -0.5
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            for group in opt.param_groups:
                group["lr"] = float(lrs[step])
            loss = F.cross_entropy(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: numpy lr
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- causal attention over a left-padded batch
class LeftPaddedAttention(nn.Module):
    """One causal self-attention head with a key padding mask, by hand or by ``scaled_dot_product_attention``."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.fused = nn.Linear(8, 24), nn.Linear(8, 8), fused

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        n = x.shape[1]
        allowed = torch.ones(n, n, dtype=torch.bool).tril() & keep[:, None, :]
        if self.fused:
            return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)  # producer: left padded
        return self.out(weights @ v)


class TinyDecoder(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.attn = LeftPaddedAttention(fused)
        self.lm_head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.attn(self.embed(ids), keep))


def _left_padded(fused: bool) -> Scenario:
    """A decoder fine-tuned on prompts padded on the left (as a generation-time tokenizer pads them), the loss taken
    on the last token only. Until step 2 the batches hold full-length prompts; step 2 holds a short one: its pad
    queries may attend only to earlier pad keys, so their rows are fully masked and the softmax is ``0 / 0``. The
    twin uses ``F.scaled_dot_product_attention`` with the same boolean mask: torch gives 0 for a fully masked row."""
    torch.manual_seed(0)
    model = TinyDecoder(fused)
    ids = [torch.randint(1, 16, (3, 5)) for _ in range(4)]
    keep = [torch.ones(3, 5, dtype=torch.bool) for _ in range(4)]
    keep[2][1, :2] = False
    ids[2][1, :2] = 0
    targets = [torch.randint(1, 16, (3,)) for _ in range(4)]
    return _loop(model, lambda step: (ids[step], keep[step]),
                 lambda logits, step: F.cross_entropy(logits[:, -1], targets[step]))


# ---------------------------------------------------------------- class-incremental rows renormalised in place
class CosineHead(nn.Module):
    """A weight-normalised classifier (LUCIR-style): the loop keeps each class row at unit norm itself."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.weight = nn.Parameter(F.normalize(torch.randn(classes, 8), dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 10.0 * F.linear(F.normalize(self.body(x), dim=-1), self.weight)


def _incremental(new_rows_random: bool) -> Scenario:
    """Class-incremental learning: at step 2 the task's two new classes arrive; their rows are appended initialised to
    zeros (a fresh optimizer over the grown model), and the loop's renormalisation of every row before the step,
    ``weight.div_(weight.norm(dim=1, keepdim=True))`` under ``no_grad``, divides the new rows by 0. The twin
    initialises them at random, as LUCIR does."""
    torch.manual_seed(0)
    model = CosineHead(3)
    xs = _batches(6, 6)
    ys = [torch.randint(0, 3, (6,)) for _ in range(2)] + [torch.randint(0, 5, (6,)) for _ in range(2)]
    grown = torch.randn(2, 8) if new_rows_random else torch.zeros(2, 8)
    holder: dict[str, torch.optim.Optimizer] = {"opt": torch.optim.SGD(model.parameters(), lr=0.05)}

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                model.weight = nn.Parameter(torch.cat([model.weight.detach(), grown]))
                holder["opt"] = torch.optim.SGD(model.parameters(), lr=0.05)
            with torch.no_grad():
                model.weight.div_(model.weight.norm(dim=1, keepdim=True))  # producer: incremental rows
            loss = F.cross_entropy(model(xs[step]), ys[step])
            holder["opt"].zero_grad()
            loss.backward()
            holder["opt"].step()
            losses.append(loss.detach())
        return losses

    return Scenario((model,), run)


# ---------------------------------------------------------------- a Poisson count head with a ReLU rate
class CountHead(nn.Module):
    """Predicts an event rate per sample, by ``relu`` (the incident) or ``softplus`` plus a floor."""

    def __init__(self, smooth: bool) -> None:
        super().__init__()
        self.net, self.smooth = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1)), smooth
        with torch.no_grad():
            self.net[2].bias.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x).squeeze(-1)
        return F.softplus(out) + 1e-4 if self.smooth else F.relu(out)


def _poisson_rate(smooth: bool) -> Scenario:
    """``-Poisson(rate).log_prob(counts)``, ``xlogy(k, rate) - rate - lgamma(k + 1)``: step 2 holds a shop whose
    features put the ReLU rate at exactly 0 (a tanh layer saturated by a reading 100 times its scale) and that
    sold 2 items: ``xlogy(2, 0)`` is ``-inf``. The twin takes ``softplus`` plus a floor."""
    torch.manual_seed(0)
    model = CountHead(smooth)
    xs = _batches(6, 5)
    counts = [torch.randint(0, 6, (6,)).float() for _ in range(4)]
    with torch.no_grad():  # the reading, of 256 directions, the net puts lowest: a rate far below 0 at 100 times it
        directions = 100.0 * F.normalize(torch.randn(256, 5, generator=torch.Generator().manual_seed(1)), dim=-1)
        xs[2][3] = directions[model.net(directions).squeeze(-1).argmin()]
    counts[2][3] = 2.0

    def nll(rate: torch.Tensor, step: int) -> torch.Tensor:
        return -torch.distributions.Poisson(rate, validate_args=False).log_prob(counts[step]).mean()  # producer: rate

    return _loop(model, lambda step: (xs[step],), nll, lr=1e-3)


# ---------------------------------------------------------------- a float16 additive mask of finfo.min
class HalfMaskedAttention(nn.Module):
    """Self-attention in float16 with an additive padding mask of ``finfo(float16).min``, as HF models build it."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.qkv, self.fused = nn.Linear(8, 24), fused

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        bias = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, torch.finfo(x.dtype).min)[:, None, :]
        if self.fused:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(8) + bias  # producer: half mask
        return scores.softmax(-1) @ v


def _half_mask(fused: bool) -> Scenario:
    """A float16 model (``model.half()``) over batches with padding; step 2 holds an empty sample (every key padded,
    a blank line the collator kept): ``finfo.min`` plus a negative score rounds to ``-inf`` in float16, and the row is
    all ``-inf``, its softmax NaN. The twin calls ``F.scaled_dot_product_attention`` with the same mask."""
    torch.manual_seed(0)
    model = nn.Sequential()
    attn = HalfMaskedAttention(fused)
    model.add_module("attn", attn)
    model = model.half()
    xs = [torch.randn(3, 4, 8).half() for _ in range(4)]
    keep = [torch.ones(3, 4, dtype=torch.bool) for _ in range(4)]
    for k in keep:
        k[0, 3:] = False
    keep[2][1] = False
    with torch.no_grad():  # the empty sample's scores all negative: finfo.min + score overflows on any kernel
        attn.qkv.bias.zero_()
        xs[2][1] = 0.0
        attn.qkv.bias[:8] = 4.0
        attn.qkv.bias[8:16] = -4.0

    def run() -> list[torch.Tensor]:
        return [attn(xs[step], keep[step]).float().sum() for step in range(4)]

    return Scenario((attn,), run)


#: The masked KL's NaN gradient into the policy's output, replayed, meets the policy's -inf fill and is taken as
#: that deliberate infinity; reading it as the event (hunt-s38's fix) stopped healthy masked softmax and
#: torch.where idioms whose NaN output gradient the mask zeroes (calm_s38_masks.py): taken back.
_KL_BENIGN = ("the NaN gradient into the masked policy's output is taken for the policy's deliberate -inf fill, so "
              "the NaN it spreads to net.0.weight is reported later: 'the SGD step made net.0.weight 96 nan' (phase "
              "optimizer; deferred: forward at step 3, parameter-already-nonfinite). Telling it from a healthy mask "
              "needs to know whether the NaN reached a parameter's gradient")
_KL_NO_OP = ("the per-module watch names backward at step 2, but its replay of the loss code's backward does not "
             "know the policy's -inf fill is deliberate, so -inf - -inf has no origin and no op is named")

CASES = [
    Case("hunt_s38_kl_between_masked_categorical_policies", lambda: _policy_kl(float("-inf")),
         Expect("backward", None, step=2, op="aten.mul.Tensor", marker="policy kl"),
         gaps=(("default", _KL_BENIGN), ("defer", _KL_BENIGN), ("full", _KL_NO_OP))),
    Case("hunt_s38_kl_between_policies_masked_with_finfo_min_healthy",
         lambda: _policy_kl(torch.finfo(torch.float32).min), None),
    Case("hunt_s38_behaviour_cloning_of_a_now_illegal_action", lambda: _cloning(False),
         Expect("forward", None, step=2, op="aten.gather.default", marker="cloning", cause="masked-softmax")),
    Case("hunt_s38_behaviour_cloning_mask_keeps_the_demo_action_healthy", lambda: _cloning(True), None),
    Case("hunt_s38_void_class_weight_zero_over_an_all_void_crop", lambda: _void_weight(False),
         Expect("forward", None, step=2, op="aten.nll_loss2d_forward.default", marker="void weight",
                cause="empty-reduction")),
    Case("hunt_s38_void_class_weight_zero_total_clamped_healthy", lambda: _void_weight(True), None),
    Case("hunt_s38_uncertainty_weighting_by_sigma_initialised_to_zero", lambda: _uncertainty(False),
         Expect("forward", "", "TwoTaskNet", step=0, op="aten.div.Tensor", marker="task weighting",
                cause="division-by-zero")),
    Case("hunt_s38_uncertainty_weighting_by_log_variance_healthy", lambda: _uncertainty(True), None),
    Case("hunt_s38_numpy_inverse_sqrt_lr_from_step_zero", lambda: _numpy_schedule(False),
         Expect("optimizer", "0", "Linear", step=0, op="aten.add_.Tensor", marker="numpy lr",
                cause="nonfinite-number")),
    Case("hunt_s38_numpy_inverse_sqrt_lr_from_step_one_healthy", lambda: _numpy_schedule(True), None),
    Case("hunt_s38_causal_attention_over_a_left_padded_prompt", lambda: _left_padded(False),
         Expect("forward", "attn", "LeftPaddedAttention", step=2, op="aten._softmax.default", marker="left padded",
                cause="masked-softmax")),
    Case("hunt_s38_left_padded_prompt_through_sdpa_healthy", lambda: _left_padded(True), None),
    Case("hunt_s38_class_incremental_zero_rows_renormalised_in_place", lambda: _incremental(False),
         Expect("optimizer", "", "CosineHead", step=2, op="aten.div_.Tensor", marker="incremental rows",
                cause="division-by-zero", says=(("default", "the loop's own code wrote weight"),))),
    Case("hunt_s38_class_incremental_random_rows_renormalised_healthy", lambda: _incremental(True), None),
    Case("hunt_s38_poisson_log_prob_of_a_relu_rate_of_zero", lambda: _poisson_rate(False),
         Expect("forward", None, step=2, op="aten.xlogy.Tensor", marker="rate", cause="log-domain")),
    Case("hunt_s38_poisson_log_prob_of_a_softplus_rate_healthy", lambda: _poisson_rate(True), None),
    Case("hunt_s38_float16_finfo_min_mask_of_an_empty_sample", lambda: _half_mask(False),
         Expect("forward", "", "HalfMaskedAttention", step=2, op="aten.add.Tensor", marker="half mask",
                cause="half-precision-overflow")),
    Case("hunt_s38_float16_finfo_min_mask_through_sdpa_healthy", lambda: _half_mask(True), None),
]
