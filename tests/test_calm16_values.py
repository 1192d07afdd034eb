"""Intentional non-finite values in healthy training code stay calm in the five modes (issue 25; harness:
test_calm16.py): -inf masks (causal, padding, an sdpa float mask, two finfo.min masks summed to -inf), ``inf`` as an
initial best, ``nan_to_num`` after a log, ``torch.where(x > 0, log(x), 0)`` whose unselected branch is NaN,
``masked_fill(-inf)`` -> softmax -> ``nan_to_num`` over a fully padded row, label smoothing with ignore_index,
a masked policy (Categorical over -inf logits), a distribution's -inf log_prob outside its support masked away.
The broken twins (the same code one step from healthy) still name the producer.
"""

from __future__ import annotations

import pytest
import torch
from test_calm16 import Loop, assert_calm, sgd_loop
from torch import nn
from torch.nn import functional as F
from watching import FIVE_MODES, raised

NEG_INF = float("-inf")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Attention(nn.Module):
    """Single-head self-attention written by hand; ``mask`` decides how the scores are masked."""

    def __init__(self, mask: str, d: int = 8) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mask = mask

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # keep: (b, t) bool, False = padding
        q, k, v = self.qkv(x).chunk(3, -1)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        if self.mask == "sdpa-float":  # an additive float mask: 0 where kept, -inf where masked
            bias = torch.zeros(x.shape[0], 1, t, t).masked_fill(~(causal & keep[:, None, None, :]), NEG_INF)
            return self.out(F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=bias)[:, 0])
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if self.mask == "causal":
            scores = scores.masked_fill(~causal, NEG_INF)
        elif self.mask == "finfo-summed":  # HF style: each mask (1 - m) * finfo.min, their sum is -inf (overflow)
            low = torch.finfo(scores.dtype).min
            scores = scores + (~causal).float() * low + (~keep[:, None, :]).float() * low
        elif self.mask in ("padding-nan_to_num", "padding-no-cleaning"):  # a sequence all padding: a NaN row
            scores = scores.masked_fill(~keep[:, None, :], NEG_INF)
        attn = scores.softmax(-1)
        if self.mask == "padding-nan_to_num":
            attn = attn.nan_to_num(0.0)
        return self.out(attn @ v)


def _keep(step: int, b: int = 3, t: int = 5, empty: bool = False) -> torch.Tensor:
    keep = torch.ones(b, t, dtype=torch.bool)
    keep[1, 3:] = False
    if empty:
        keep[2] = False  # a sequence that is all padding (an empty document in the batch)
    else:
        keep[2, 1:] = False
    return keep


def attention_loop(mask: str, empty: bool = False) -> Loop:
    model = Attention(mask)
    xs = [torch.randn(3, 5, 8) for _ in range(3)]
    return sgd_loop(model, lambda m, step: m(xs[step], _keep(step, empty=empty)).pow(2).mean())


class Running(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def inf_best_loop() -> Loop:
    """``best = float('inf')`` / a tensor ``inf`` updated with ``torch.minimum``: the start of a running minimum."""
    model = Running()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def run() -> list[torch.Tensor]:
        best, best_t, worst = float("inf"), torch.tensor(float("inf")), torch.full((1,), NEG_INF)
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < best:
                best = loss.item()
            best_t = torch.minimum(best_t, loss.detach())
            worst = torch.maximum(worst, loss.detach())
        return [torch.tensor(best), best_t, worst]
    return Loop((model, opt), (model, opt), run)


def soft_target_kl_loop() -> Loop:
    """A KL loss against sparse soft targets written by hand: ``target.log()`` is -inf at the zeros, and
    ``nan_to_num`` replaces it before ``target *`` (0 * -inf would be NaN)."""
    model = nn.Linear(6, 5)
    x = torch.randn(8, 6)
    target = torch.zeros(8, 5)
    target[:, :2] = 0.5

    def loss_of(m: nn.Module, step: int) -> torch.Tensor:
        logp = m(x).log_softmax(-1)
        return (target * (target.log().nan_to_num(neginf=0.0) - logp)).sum(-1).mean()
    return sgd_loop(model, loss_of)


class WhereLog(nn.Module):
    """``torch.where(h > 0, log(h), 0)``: log of the negative entries is NaN, the where drops it. Its backward
    sends 0 * (1/h) there: -0 for h < 0, NaN for h == 0 (``gated``, the broken twin: features multiplied by a 0/1
    gate; relu or clamp would mask that NaN in their own backward, the multiplication passes it on)."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
        self.gated = gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.gated:
            h = h * (torch.arange(8) % 2).float()
        return self.head(torch.where(h > 0, torch.log(h), torch.zeros_like(h)))  # log, where


def where_log_loop(gated: bool = False) -> Loop:
    x = torch.randn(16, 4)
    return sgd_loop(WhereLog(gated), lambda m, step: m(x).pow(2).mean(), lr=0.01)


def label_smoothing_loop() -> Loop:
    """A token classifier with padding labelled -100, label smoothing 0.1."""
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
    ids = torch.randint(1, 20, (4, 6))
    labels = ids.roll(-1, 1).masked_fill(torch.arange(6) >= 4, -100)
    return sgd_loop(model, lambda m, step: F.cross_entropy(m(ids).flatten(0, 1), labels.flatten(),
                                                           ignore_index=-100, label_smoothing=0.1))


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.net(obs).masked_fill(~legal, NEG_INF))


def masked_policy_loop() -> Loop:
    """REINFORCE with illegal actions masked to -inf logits: log_prob of the taken (legal) action, an entropy
    bonus (Categorical clamps -inf logits to finfo.min for it)."""
    model = Policy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    obs = torch.randn(8, 6)
    legal = torch.rand(8, 5) > 0.4
    legal[:, 0] = True

    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(3):
            dist = model(obs, legal)
            action = dist.sample()
            reward = torch.randn(8)
            loss = -(dist.log_prob(action) * reward).mean() - 0.01 * dist.entropy().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out += [action, loss.detach()]
        return out
    return Loop((model, opt), (model, opt), run)


class Density(nn.Module):
    """A learned Normal over samples, plus a Uniform prior term that is -inf outside its support (masked away)."""

    def __init__(self) -> None:
        super().__init__()
        self.loc, self.log_scale = nn.Parameter(torch.zeros(())), nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nll = -torch.distributions.Normal(self.loc, self.log_scale.exp()).log_prob(x)
        prior = torch.distributions.Uniform(-2.0, 2.0, validate_args=False).log_prob(x)  # -inf outside [-2, 2)
        return nll - torch.where(torch.isfinite(prior), prior, torch.zeros_like(prior))


def distribution_loop() -> Loop:
    x = torch.randn(64) * 2
    return sgd_loop(Density(), lambda m, step: m(x).mean(), lr=0.01)


VALUES = {
    "causal-inf-mask": lambda: attention_loop("causal"),
    "sdpa-float-mask": lambda: attention_loop("sdpa-float"),
    "finfo-min-masks-summed": lambda: attention_loop("finfo-summed"),
    "empty-row-softmax-nan_to_num": lambda: attention_loop("padding-nan_to_num", empty=True),
    "inf-initial-best": inf_best_loop,
    "nan_to_num-of-a-log-in-the-loss": soft_target_kl_loop,
    "where-log-unselected-nan": where_log_loop,
    "label-smoothing-ignore-index": label_smoothing_loop,
    "masked-policy-categorical": masked_policy_loop,
    "uniform-log-prob-outside-support": distribution_loop,
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", VALUES)
def test_intentional_nonfinite_values_are_calm(name: str, options: dict) -> None:
    assert_calm(VALUES[name], options)


def test_the_healthy_twins_really_hold_nonfinite_values_and_stay_finite() -> None:
    torch.manual_seed(0)
    assert torch.isnan(torch.zeros(5).masked_fill(~_keep(0, empty=True)[2], NEG_INF).softmax(-1)).all()
    torch.manual_seed(0)
    loop = where_log_loop()
    h = loop.targets[0].lin(torch.randn(16, 4))
    assert (h < 0).any() and not (h == 0).any()
    for build in VALUES.values():
        torch.manual_seed(0)
        loop = build()
        loop.run()
        assert all(torch.isfinite(p).all() and (p.grad is None or torch.isfinite(p.grad).all())
                   for p in loop.targets[0].parameters())


# ---------------------------------------------------------------- broken twins


def _raised(loop: Loop, options: dict):
    return raised(loop.run, *loop.targets, **options)


@pytest.mark.parametrize("options", FIVE_MODES)
def test_an_empty_row_softmax_without_nan_to_num_is_named(options: dict) -> None:
    torch.manual_seed(0)
    report = _raised(attention_loop("padding-no-cleaning", empty=True), options)
    assert (report.phase, report.module, report.step, report.op) == ("forward", "", 0, "aten._softmax.default")
    assert report.cause.label == "masked-softmax"


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_where_guarded_log_of_an_exact_zero_is_named_in_backward(options: dict) -> None:
    # the gate makes exact zeros: log(0) = -inf is dropped by the where, but its backward is 0 * (1/0) = NaN.
    torch.manual_seed(0)
    report = _raised(where_log_loop(gated=True), options)
    assert (report.phase, report.module, report.step, report.op) == ("backward", "", 0, "aten.div.Tensor")
    assert report.cause.label == "log-domain"
    assert report.source is not None and "torch.log(h)" in report.source.line


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_batch_whose_labels_are_all_ignored_is_named_at_the_loss(options: dict) -> None:
    # cross_entropy's mean over zero kept targets is 0 / 0: a real NaN loss, at step 1 where the batch is all padding.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
    ids = torch.randint(1, 20, (4, 6))

    def loss_of(m: nn.Module, step: int) -> torch.Tensor:
        labels = ids if step != 1 else torch.full_like(ids, -100)
        return F.cross_entropy(m(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)  # loss
    report = _raised(sgd_loop(model, loss_of), options)
    assert (report.phase, report.module, report.step) == ("forward", None, 1)
    assert report.op == "aten.nll_loss_forward.default" and (report.nan, report.numel) == (1, 1)
    assert report.cause.label == "empty-reduction"  # (the cause says: a mean over zero kept targets)
    assert report.source is not None and "F.cross_entropy(" in report.source.line
