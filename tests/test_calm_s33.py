"""Healthy models and values a user trains with the watch on (calm_s33), every mode.

Each row is a loop (tests/calm_s30.py: the harness, what is compared), each a variant earlier rounds did not run:
selective activation checkpointing (context_fn), a reentrant checkpoint called from the loop around a child the
loop calls itself, checkpoint_sequential from the loop over a net with dropout; scaled_dot_product_attention with
dropout and a finfo.min key mask, with a fully masked padding query row repaired by where(), and by hand with
a -inf mask whose NaN row nan_to_num repairs;
MultiheadAttention with a float -inf key_padding_mask and a causal mask, need_weights=False; an unsorted packed
bidirectional LSTM unpacked with padding_value=-inf and max-pooled over time; PPO epochs over a rollout of a
Categorical policy with -inf masked actions, its entropy and log_prob; the user's forward hook (prepend) on the root
and full backward pre-hook on a child; a traced child and a scripted child with a -inf mask; a custom Function
with save_for_backward whose backward is differentiable (a gradient penalty through it); weight_norm (old, removed
mid-loop; parametrizations, removed mid-loop); a top-k masked softmax; a log(0) metric printed as -inf; log of a
ReLU repaired by nan_to_num in the forward; a NaN-masked error averaged by nanmean; an int8 dynamically quantized
copy for evaluation; FGSM adversarial training (the model frozen while the input's gradient is taken); buffers that
hold +inf and -inf on purpose (a running min-max range, a running max, the best loss), the first batch's range
written over them.
test_calm_s33_loops.py: loop shapes.
"""

from __future__ import annotations

import copy
import functools
import io
import warnings

import pytest
import torch
from calm_s30 import MODES, Row, check, data, mlp, sgd, steps
from torch import nn
from torch.distributions import Categorical
from torch.nn import functional as F
from torch.nn.utils import parametrizations, parametrize
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.checkpoint import checkpoint, checkpoint_sequential, create_selective_checkpoint_contexts

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)

NEG_INF = float("-inf")


# -- activation checkpointing ------------------------------------------------------------------------------


class SelectiveBlock(nn.Module):
    """A residual block checkpointed non-reentrantly with a policy that saves the matmuls (selective AC)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.ff, self.out = nn.Linear(6, d), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                                        nn.Linear(2 * d, d)), nn.Linear(d, 3)
        self.policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + checkpoint(self.ff, h, use_reentrant=False, context_fn=self.policy)
        return self.out(h)


def selective_checkpoint() -> Row:
    model = SelectiveBlock()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = data()
    return Row((model, opt), (model, opt), steps(model, opt, lambda step: F.cross_entropy(model(x), y)))


def reentrant_checkpoint_from_the_loop() -> Row:
    """The loop calls the embedding itself and the body through checkpoint(use_reentrant=True): the body's forward
    runs again inside the backward."""
    emb, body = nn.Embedding(20, 8), nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 3))
    model = nn.ModuleDict({"emb": emb, "body": body})
    opt = sgd(model)
    tokens, y = torch.randint(0, 20, (8,)), torch.randint(0, 3, (8,))

    def loss_of(step: int) -> torch.Tensor:
        return F.cross_entropy(checkpoint(body, emb(tokens), use_reentrant=True), y)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def checkpoint_sequential_from_the_loop() -> Row:
    """checkpoint_sequential(model, 2, x, use_reentrant=False) over the whole Sequential, dropout in a segment."""
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    opt = sgd(model)
    x, y = data()
    x.requires_grad_(True)

    def loss_of(step: int) -> torch.Tensor:
        return F.cross_entropy(checkpoint_sequential(model, 2, x, use_reentrant=False), y)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


# -- attention ---------------------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    """One head of attention by scaled_dot_product_attention; ``repair`` says how a fully masked padding query row
    is put back to 0 ('where' or 'nan_to_num'), ``mask`` which mask is passed ('finfo' float or 'bool')."""

    def __init__(self, mask: str, repair: str | None = None, dropout: float = 0.0, d: int = 8) -> None:
        super().__init__()
        self.mask, self.repair, self.dropout = mask, repair, dropout
        self.qkv, self.head = nn.Linear(d, 3 * d), nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        pair = valid[:, None, :] & valid[:, :, None]  # a padding query sees no key at all
        if self.mask == "finfo":
            keys = valid[:, None, :].expand_as(pair)
            mask = torch.zeros(pair.shape).masked_fill(~keys, torch.finfo(torch.float32).min)
        elif self.mask == "bool":
            mask = pair
        if self.mask == "neg_inf":  # by hand: softmax over a fully masked row is NaN (SDPA's kernels give 0)
            scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
            out = torch.nan_to_num(torch.softmax(scores.masked_fill(~pair, NEG_INF), dim=-1), nan=0.0) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 dropout_p=self.dropout if self.training else 0.0)
        if self.repair == "where":
            out = torch.where(valid[..., None], out, torch.zeros(()))
        pooled = out.sum(1) / valid.sum(1, keepdim=True)
        return self.head(pooled)


def _tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 5, 8)
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    return x, valid, torch.randint(0, 3, (4,))


def _attention_row(model: nn.Module) -> Row:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, valid, y = _tokens()
    return Row((model, opt), (model, opt), steps(model, opt, lambda step: F.cross_entropy(model(x, valid), y)))


def sdpa_dropout_finfo_min_mask() -> Row:
    return _attention_row(SelfAttention("finfo", dropout=0.2))


def sdpa_bool_mask_padding_row_by_where() -> Row:
    return _attention_row(SelfAttention("bool", repair="where"))


def sdpa_neg_inf_mask_padding_row_by_nan_to_num() -> Row:
    return _attention_row(SelfAttention("neg_inf"))


class MhaClassifier(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros(valid.shape).masked_fill(~valid, NEG_INF)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        out, weights = self.attn(x, x, x, key_padding_mask=pad, attn_mask=causal.float().masked_fill(causal, NEG_INF),
                                 need_weights=False)
        assert weights is None
        return self.head((out * valid[..., None]).sum(1) / valid.sum(1, keepdim=True))


def mha_float_key_padding_and_causal() -> Row:
    return _attention_row(MhaClassifier())


# -- sequences and policies --------------------------------------------------------------------------------


class PackedMaxPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm, self.head = nn.Embedding(12, 6), nn.LSTM(6, 5, batch_first=True, bidirectional=True), \
            nn.Linear(10, 3)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.emb(tokens), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True, padding_value=NEG_INF)
        return self.head(padded.max(dim=1).values)


def packed_lstm_max_pool_over_neg_inf_padding() -> Row:
    """Unsorted lengths, a bidirectional LSTM, padding_value=-inf so that the max over time ignores padding."""
    model = PackedMaxPool()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tokens, lengths, y = torch.randint(1, 12, (4, 6)), torch.tensor([3, 6, 2, 5]), torch.randint(0, 3, (4,))
    return Row((model, opt), (model, opt), steps(model, opt, lambda step: F.cross_entropy(model(tokens, lengths), y)))


def ppo_epochs_over_masked_rollout() -> Row:
    """A rollout sampled under no_grad from Categorical(logits=logits.masked_fill(~legal, -inf)); two PPO epochs of
    the clipped surrogate with an entropy bonus over it, the old log_probs kept from the rollout."""
    policy = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
    opt = torch.optim.Adam(policy.parameters(), lr=0.003)
    states = torch.randn(16, 6)
    legal = torch.rand(16, 5) > 0.4
    legal[:, 0] = True

    def dist(s: torch.Tensor) -> Categorical:
        return Categorical(logits=policy(s).masked_fill(~legal, NEG_INF))

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(2):
                with torch.no_grad():
                    d = dist(states)
                    actions = d.sample()
                    old = d.log_prob(actions)
                    adv = torch.randn(16)
                for _ in range(2):
                    d = dist(states)
                    ratio = (d.log_prob(actions) - old).exp()
                    surrogate = torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
                    loss = -surrogate.mean() - 0.01 * d.entropy().mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    out.append(loss.detach())
        return out

    return Row((policy, opt), (policy, opt), run)


# -- the user's hooks, scripted and traced modules ---------------------------------------------------------


def user_root_forward_hook_and_backward_pre_hook() -> Row:
    """The user's hooks, on before the watch and left on after: a temperature forward hook on the root registered
    with prepend=True, a full backward pre-hook that clips the gradient flowing into a child's output."""
    model = mlp()
    opt = sgd(model)
    x, y = data()
    model.register_forward_hook(lambda m, args, out: out / 2.0, prepend=True)
    model[2].register_full_backward_pre_hook(lambda m, grad_out: (grad_out[0].clamp(-0.01, 0.01),))
    return Row((model, opt), (model, opt), steps(model, opt, lambda step: F.cross_entropy(model(x), y)))


def traced_child() -> Row:
    """A model whose encoder is torch.jit.trace(...) of a Sequential, trained with its head."""
    encoder = torch.jit.trace(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8)), torch.randn(2, 6))
    model = nn.Sequential(encoder, nn.Tanh(), nn.Linear(8, 3))
    opt = sgd(model)
    x, y = data()
    return Row((model, opt), (model, opt), steps(model, opt, lambda step: F.cross_entropy(model(x), y)))


class MaskedScorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.proj(x).masked_fill(~keep, float("-inf")), dim=-1)


class WithScriptedScorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.scorer = nn.Linear(6, 6), torch.jit.script(MaskedScorer())

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.scorer(torch.tanh(self.inp(x)), keep)


def scripted_child_with_inf_mask() -> Row:
    """A model whose scorer is torch.jit.script of a module that masks with -inf and takes a log_softmax (each row
    keeps one entry). (A scripted root is refused with a clear error: tests/test_jit_modules.py.)"""
    model = WithScriptedScorer()
    opt = sgd(model)
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    keep = torch.rand(8, 5) > 0.5
    keep[torch.arange(8), y] = True
    return Row((model, opt), (model, opt), steps(model, opt, lambda step: F.nll_loss(model(x, keep), y)))


class SoftClip(torch.autograd.Function):
    """x * sigmoid(x) with its gradient written by hand from saved tensors, differentiable (double backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, s = ctx.saved_tensors
        return g * (s + x * s * (1 - s))


def custom_function_double_backward() -> Row:
    """A gradient penalty on the input through the custom Function: autograd.grad(create_graph=True) then one
    backward through its backward."""
    lin1, lin2 = nn.Linear(6, 16), nn.Linear(16, 3)
    model = nn.ModuleList([lin1, lin2])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = data()

    def loss_of(step: int) -> torch.Tensor:
        xi = x.clone().requires_grad_(True)
        loss = F.cross_entropy(lin2(SoftClip.apply(lin1(xi))), y)
        (g,) = torch.autograd.grad(loss, xi, create_graph=True)
        return loss + 0.1 * g.pow(2).sum()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


# -- weight norm -------------------------------------------------------------------------------------------


def weight_norm(kind: str) -> Row:
    """Weight norm on the first layer for two steps, removed at step 2 (the optimizer rebuilt on the plain
    weight), one more step: the old torch.nn.utils.weight_norm or parametrizations.weight_norm."""
    model = mlp()
    x, y = data()
    if kind == "old":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.nn.utils.weight_norm(model[0])
    else:
        parametrizations.weight_norm(model[0])

    def run(watching) -> list[torch.Tensor]:
        out = []
        opt = sgd(model)
        with watching():
            for step in range(3):
                if step == 2:
                    if kind == "old":
                        torch.nn.utils.remove_weight_norm(model[0])
                    else:
                        parametrize.remove_parametrizations(model[0], "weight")
                    opt = sgd(model)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model,), (model,), run)


# -- values a user makes on purpose ------------------------------------------------------------------------


class TopK(nn.Module):
    def __init__(self, k: int = 2) -> None:
        super().__init__()
        self.k, self.scores, self.values = k, nn.Linear(6, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scores(x)
        kth = s.topk(self.k, dim=-1).values[..., -1:]
        w = torch.softmax(s.masked_fill(s < kth, NEG_INF), dim=-1)
        return self.values(w * s)


def top_k_masked_softmax() -> Row:
    model = TopK()
    opt = sgd(model)
    x, y = data()
    return Row((model, opt), (model, opt), steps(model, opt, lambda step: F.cross_entropy(model(x), y)))


def log_zero_metric_printed() -> Row:
    """Under no_grad the loop prints the log of the smallest predicted probability of a masked class, -inf."""
    model = mlp(6, 4)
    opt = sgd(model)
    x, y = data(classes=3)
    banned = torch.tensor([False, False, False, True])

    def run(watching) -> list:
        out, printed = [], io.StringIO()
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x).masked_fill(banned, NEG_INF), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    probs = torch.softmax(model(x).masked_fill(banned, NEG_INF), -1)
                    metric = torch.log(probs.min())
                    print(f"loss {loss.item():.4f} log min p {metric.item()}", file=printed)
                out += [loss.detach(), metric]
        assert "log min p -inf" in printed.getvalue()
        return out

    return Row((model, opt), (model, opt), run)


class LogRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nan_to_num(torch.log(F.relu(self.a(x))), neginf=-10.0))


def log_of_relu_repaired_by_nan_to_num() -> Row:
    model = LogRelu()
    opt = sgd(model)
    x, y = data()
    return Row((model, opt), (model, opt), steps(model, opt, lambda step: F.cross_entropy(model(x), y)))


def nan_masked_error_by_nanmean() -> Row:
    """Regression targets with NaN where unlabeled: the squared error of the filled targets, set back to NaN where
    unlabeled by masked_fill, averaged by nanmean."""
    model = mlp(6, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    y[torch.rand(8, 2) < 0.3] = float("nan")
    missing = y.isnan()

    def loss_of(step: int) -> torch.Tensor:
        err = (model(x) - y.nan_to_num()).pow(2).masked_fill(missing, float("nan"))
        return err.nanmean()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def int8_quantized_copy_for_eval() -> Row:
    """Each step an int8 dynamically quantized deep copy of the model is evaluated (quantize_dynamic)."""
    model = mlp()
    opt = sgd(model)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    q = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model).eval(), {nn.Linear}, torch.qint8)
                with torch.no_grad():
                    out += [loss.detach(), F.cross_entropy(q(x), y)]
        return out

    return Row((model, opt), (model, opt), run)


def fgsm_adversarial_training() -> Row:
    """FGSM: the model frozen by requires_grad_(False) while the input's gradient is taken, unfrozen, then trained on
    the clean and the perturbed batch."""
    model = mlp()
    opt = sgd(model)
    x, y = data()

    def loss_of(step: int) -> torch.Tensor:
        model.requires_grad_(False)
        xi = x.clone().requires_grad_(True)
        F.cross_entropy(model(xi), y).backward()
        adv = (x + 0.1 * xi.grad.sign()).detach()
        model.requires_grad_(True)
        return F.cross_entropy(model(x), y) + F.cross_entropy(model(adv), y)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


class RunningExtremes(nn.Module):
    """Buffers that hold infinities on purpose: a min-max scaler's running range starts at (+inf, -inf) and widens
    with each training batch; the largest logit seen starts at -inf; the loop keeps the best loss, +inf at first."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("lo", torch.full((6,), float("inf")))
        self.register_buffer("hi", torch.full((6,), NEG_INF))
        self.register_buffer("max_logit", torch.tensor(NEG_INF))
        self.register_buffer("best_loss", torch.tensor(float("inf")))
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.lo.copy_(torch.minimum(self.lo, x.min(0).values))
                self.hi.copy_(torch.maximum(self.hi, x.max(0).values))
        out = self.net((x - self.lo) / (self.hi - self.lo + 1e-6))
        with torch.no_grad():
            self.max_logit.copy_(torch.maximum(self.max_logit, out.max()))
        return out


def buffers_holding_infinities() -> Row:
    model = RunningExtremes()
    opt = sgd(model)
    batches = [data() for _ in range(3)]

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for x, y in batches:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    model.best_loss.copy_(torch.minimum(model.best_loss, loss))
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


ROWS = {
    "selective_checkpoint": selective_checkpoint,
    "reentrant_checkpoint_from_the_loop": reentrant_checkpoint_from_the_loop,
    "checkpoint_sequential_from_the_loop": checkpoint_sequential_from_the_loop,
    "sdpa_dropout_finfo_min_mask": sdpa_dropout_finfo_min_mask,
    "sdpa_bool_mask_padding_row_by_where": sdpa_bool_mask_padding_row_by_where,
    "sdpa_neg_inf_mask_padding_row_by_nan_to_num": sdpa_neg_inf_mask_padding_row_by_nan_to_num,
    "mha_float_key_padding_and_causal": mha_float_key_padding_and_causal,
    "packed_lstm_max_pool_over_neg_inf_padding": packed_lstm_max_pool_over_neg_inf_padding,
    "ppo_epochs_over_masked_rollout": ppo_epochs_over_masked_rollout,
    "user_root_forward_hook_and_backward_pre_hook": user_root_forward_hook_and_backward_pre_hook,
    "traced_child": traced_child,
    "scripted_child_with_inf_mask": scripted_child_with_inf_mask,
    "custom_function_double_backward": custom_function_double_backward,
    "weight_norm_old_removed_mid_loop": functools.partial(weight_norm, "old"),
    "weight_norm_parametrization_removed_mid_loop": functools.partial(weight_norm, "parametrization"),
    "top_k_masked_softmax": top_k_masked_softmax,
    "log_zero_metric_printed": log_zero_metric_printed,
    "log_of_relu_repaired_by_nan_to_num": log_of_relu_repaired_by_nan_to_num,
    "nan_masked_error_by_nanmean": nan_masked_error_by_nanmean,
    "int8_quantized_copy_for_eval": int8_quantized_copy_for_eval,
    "fgsm_adversarial_training": fgsm_adversarial_training,
    "buffers_holding_infinities": buffers_holding_infinities,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_models_and_values_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)


def test_the_rows_really_meet_what_they_handle() -> None:
    """The rows' infinities are really there: the padding query row of a -inf-masked SDPA, the -inf padding the
    max-pool skips, the log of ReLU's zeros; and the unwatched loops end with finite gradients."""
    torch.manual_seed(0)
    _, valid, _ = _tokens()
    pair = valid[:, None, :] & valid[:, :, None]
    q = torch.randn(4, 5, 8)
    raw = torch.softmax((q @ q.transpose(-1, -2)).masked_fill(~pair, NEG_INF), -1)
    assert torch.isnan(raw[1, 4]).all()
    model = PackedMaxPool()
    packed = pack_padded_sequence(model.emb(torch.randint(1, 12, (4, 6))), torch.tensor([3, 6, 2, 5]),
                                  batch_first=True, enforce_sorted=False)
    padded, _ = pad_packed_sequence(model.lstm(packed)[0], batch_first=True, padding_value=NEG_INF)
    assert torch.isneginf(padded).any()
    lr = LogRelu()
    assert torch.isneginf(torch.log(F.relu(lr.a(torch.randn(8, 6))))).any()
    for name, build in ROWS.items():
        torch.manual_seed(0)
        row = build()
        row.run(__import__("contextlib").nullcontext)
        for held in row.held:
            if isinstance(held, nn.Module):
                assert all(p.grad is None or torch.isfinite(p.grad).all() for p in held.parameters()), name
