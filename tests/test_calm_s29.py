"""Healthy sequence and attention models with the infinities they make on purpose (calm_s29), every mode.

Each row is a loop a user leaves the watch on for (tests/calm_s29.py: the harness, what is compared): attention
with padding masks and weights, SDPA with -inf masks and is_causal, packed sequences, CTC with zero_infinity, an
LSTM with proj_size, cdist and logsumexp over -inf, beam search over masked log-probabilities, distributions without
validation, jacobians and vjps as penalties, per-sample gradients by vmap(grad), checkpointing in a loop.
test_calm_s29_loops.py: loop shapes (optimizers, schedules, dtypes, copies, seeds, nested watches, interrupts).
"""

from __future__ import annotations

import math

import pytest
import torch
from calm_s29 import MODES, Row, check, steps
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import rnn as rnn_utils

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)

NEG_INF = float("-inf")


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


# -- attention ---------------------------------------------------------------------------------------


class PaddedEncoder(nn.Module):
    """nn.MultiheadAttention with a key_padding_mask and need_weights (averaged and per head), the weights logged
    and used as an auxiliary entropy term over the real keys only."""

    def __init__(self, average: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16, padding_idx=0)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.head = nn.Linear(16, 3)
        self.average = average

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pad = tokens == 0
        h = self.embed(tokens)
        out, weights = self.attn(h, h, h, key_padding_mask=pad, need_weights=True,
                                 average_attn_weights=self.average)
        keep = (~pad).unsqueeze(-1).float()
        pooled = (out * keep).sum(1) / keep.sum(1).clamp(min=1)
        return self.head(pooled), weights


def _tokens(b: int = 4, t: int = 7) -> torch.Tensor:
    tokens = torch.randint(1, 20, (b, t))
    for i in range(b):
        tokens[i, t - i:] = 0  # row 0 unpadded, later rows padded more
    return tokens


def mha_padding(average: bool) -> Row:
    model = PaddedEncoder(average)
    opt = _sgd(model)
    tokens, y = _tokens(), torch.randint(0, 3, (4,))

    def loss_of(step: int) -> torch.Tensor:
        logits, weights = model(tokens)
        entropy = -(weights * weights.clamp(min=1e-9).log()).sum(-1).mean()
        return F.cross_entropy(logits, y) + 0.01 * entropy

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


class MaskedSdpa(nn.Module):
    """F.scaled_dot_product_attention given a float -inf mask (causal plus padding, never a whole row), or
    is_causal=True, or a boolean mask."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 2)
        self.how = how

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        if self.how == "causal":
            h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keys = torch.arange(t) < lengths[:, None]  # (b, t) real keys
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            allowed = causal[None] & keys[:, None, :]
            allowed = allowed | torch.eye(t, dtype=torch.bool)[None]  # a query always sees itself
            if self.how == "float":
                mask = torch.zeros(b, 1, t, t).masked_fill(~allowed[:, None], NEG_INF)
            else:
                mask = allowed[:, None]
            h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(h.transpose(1, 2).reshape(b, t, 8)).mean(1)


def sdpa(how: str) -> Row:
    model = MaskedSdpa(how)
    opt = _sgd(model)
    x, lengths = torch.randn(3, 6, 8), torch.tensor([6, 4, 2])
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: model(x, lengths).pow(2).mean()))


# -- recurrent -------------------------------------------------------------------------------------------


class PackedTagger(nn.Module):
    """pack_padded_sequence into an LSTM (proj_size or not) or a GRU, unpacked with a padding value the loss
    ignores."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "gru":
            self.rnn: nn.Module = nn.GRU(5, 8, batch_first=True, bidirectional=True)
            width = 16
        else:
            self.rnn = nn.LSTM(5, 8, num_layers=2, batch_first=True, proj_size=4 if kind == "proj" else 0)
            width = 4 if kind == "proj" else 8
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = rnn_utils.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = rnn_utils.pad_packed_sequence(out, batch_first=True, padding_value=0.0)
        return self.head(out)


def packed(kind: str) -> Row:
    model = PackedTagger(kind)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    lengths = torch.tensor([3, 6, 1, 5])
    x = torch.randn(4, 6, 5)
    y = torch.randint(0, 3, (4, 6))
    y[torch.arange(6)[None] >= lengths[:, None]] = -100

    def loss_of(step: int) -> torch.Tensor:
        logits = model(x, lengths)
        return F.cross_entropy(logits.flatten(0, 1), y[:, :logits.shape[1]].flatten(), ignore_index=-100)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


class Speech(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(6, 12, batch_first=True)
        self.out = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0]).log_softmax(-1)


def ctc_impossible() -> Row:
    """CTC with zero_infinity=True, reduction="sum", where one utterance is shorter than its transcript (its loss
    is inf, zeroed by torch, gradient zero)."""
    model = Speech()
    opt = _sgd(model)
    x = torch.randn(3, 8, 6)
    targets = torch.randint(1, 5, (3, 10))
    input_lengths, target_lengths = torch.tensor([8, 8, 3]), torch.tensor([4, 5, 9])
    ctc = nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)

    def loss_of(step: int) -> torch.Tensor:
        return ctc(model(x).transpose(0, 1), targets, input_lengths, target_lengths) / 3

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


# -- distances and reductions over -inf ----------------------------------------------------------------


class Prototypes(nn.Module):
    """torch.cdist to class prototypes; classes absent from the episode masked to -inf before a logsumexp, and a
    query whose every class is masked given the logsumexp's -inf, replaced by torch.where."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8))
        self.protos = nn.Parameter(torch.randn(5, 8))

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        logits = -torch.cdist(self.encode(x), self.protos)
        logits = logits.masked_fill(~present, NEG_INF)
        norm = torch.logsumexp(logits, -1, keepdim=True)
        return torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))


def cdist_logsumexp() -> Row:
    model = Prototypes()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(6, 6)
    present = torch.rand(6, 5) > 0.4
    present[2] = False  # a query with no class present: its logsumexp is -inf

    def loss_of(step: int) -> torch.Tensor:
        return model(x, present).pow(2).mean()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 16)
        self.cell = nn.GRUCell(16, 16)
        self.out = nn.Linear(16, 12)

    def forward(self, token: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.cell(self.embed(token), h)
        return self.out(h), h


def beam_search(model: Decoder, beams: int = 3, length: int = 5) -> torch.Tensor:
    """Beam search over log_softmax of logits with banned tokens at -inf; scores start at -inf but for one beam."""
    banned = torch.zeros(12, dtype=torch.bool)
    banned[[0, 7]] = True
    tokens = torch.full((beams,), 1)
    h = torch.zeros(beams, 16)
    scores = torch.tensor([0.0] + [NEG_INF] * (beams - 1))
    for _ in range(length):
        logits, h = model(tokens, h)
        logp = logits.masked_fill(banned, NEG_INF).log_softmax(-1)
        total = (scores[:, None] + logp).flatten()
        scores, index = total.topk(beams)
        tokens, h = index % 12, h[index // 12]
    return scores


def beam_search_in_training() -> Row:
    model = Decoder()
    opt = _sgd(model)
    y = torch.randint(0, 12, (4, 5))

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                h = torch.zeros(4, 16)
                loss = torch.zeros(())
                for t in range(4):
                    logits, h = model(y[:, t], h)
                    loss = loss + F.cross_entropy(logits, y[:, t + 1])
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    out += [loss.detach(), beam_search(model)]
        return out

    return Row((model, opt), (model, opt), run)


# -- distributions and autograd functionals ---------------------------------------------------------------


class BetaPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)

    def forward(self, s: torch.Tensor) -> torch.distributions.Beta:
        c = F.softplus(self.body(s)) + 1.0
        return torch.distributions.Beta(c[:, 0], c[:, 1], validate_args=False)


def beta_policy() -> Row:
    """torch.distributions with validate_args=False: actions exactly on the support's edge have log_prob -inf,
    which the loss drops by a torch.where on isfinite (the user's own guard)."""
    model = BetaPolicy()
    opt = _sgd(model)
    s = torch.randn(6, 4)
    actions = torch.rand(6)
    actions[[1, 4]] = torch.tensor([0.0, 1.0])
    advantage = torch.randn(6)

    def loss_of(step: int) -> torch.Tensor:
        logp = model(s).log_prob(actions)
        ok = torch.isfinite(logp)
        return -(torch.where(ok, logp, torch.zeros_like(logp)) * advantage).sum() / ok.sum()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def jacobian_vjp() -> Row:
    """A contractive penalty by torch.autograd.functional.jacobian(create_graph=True), and a vjp logged."""
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = _sgd(model)
    x = torch.randn(4, 3)

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                jac = torch.autograd.functional.jacobian(lambda v: model(v).sum(0), x, create_graph=True)
                _, pulled = torch.autograd.functional.vjp(lambda v: model(v), x, torch.ones(4, 3))
                loss = model(x).pow(2).mean() + 0.1 * jac.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                out += [loss.detach(), pulled]
        return out

    return Row((model, opt), (model, opt), run)


def dp_sgd() -> Row:
    """Per-sample gradients by torch.func.vmap(grad(...)), each clipped, summed, noised (DP-SGD), set as .grad."""
    from torch.func import functional_call, grad, vmap

    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = _sgd(model)
    x, y = torch.randn(6, 5), torch.randint(0, 2, (6,))

    def one(params: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, params, (xi[None],)), yi[None])

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                params = {k: v.detach() for k, v in model.named_parameters()}
                grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
                norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
                factor = (1.0 / (norms / 1.0).clamp(min=1.0))
                opt.zero_grad()
                for name, p in model.named_parameters():
                    clipped = (grads[name] * factor.view(-1, *[1] * (grads[name].dim() - 1))).sum(0)
                    p.grad = (clipped + 0.1 * torch.randn_like(clipped)) / 6
                opt.step()
                out.append(norms)
        return out

    return Row((model, opt), (model, opt), run)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.2)) for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def checkpointed(reentrant: bool) -> Row:
    """torch.utils.checkpoint over blocks with dropout (the RNG state replayed in recomputation), in a loop."""
    model = Checkpointed(reentrant)
    opt = _sgd(model)
    x = torch.randn(4, 8, requires_grad=reentrant)
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: model(x).pow(2).mean(), n=4))


class Gumbel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Linear(6, 5)
        self.codebook = nn.Linear(5, 6, bias=False)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x).masked_fill(~allowed, NEG_INF)
        return self.codebook(F.gumbel_softmax(logits, tau=0.5, hard=True))


def gumbel_hard() -> Row:
    """gumbel_softmax(hard=True) over codes banned at -inf (the sampled noise meets -inf: still -inf)."""
    model = Gumbel()
    opt = _sgd(model)
    x = torch.randn(5, 6)
    allowed = torch.rand(5, 5) > 0.3
    allowed[:, 0] = True
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: (model(x, allowed) - x).pow(2).mean()))


def transformer_padding() -> Row:
    """nn.TransformerEncoder with src_key_padding_mask, trained, then evaluated in eval() + no_grad each step (the
    nested-tensor fast path, where padded positions come back as zeros)."""
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(3, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                model.train()
                h = model(x, src_key_padding_mask=pad)
                loss = h.masked_fill(pad[..., None], 0).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    out += [loss.detach(), model(x, src_key_padding_mask=pad)]
        return out

    return Row((model, opt), (model, opt), run)


class HMM(nn.Module):
    """The forward algorithm in log space: forbidden transitions at -inf, logcumsumexp and logsumexp over them."""

    def __init__(self) -> None:
        super().__init__()
        self.emit = nn.Linear(3, 4)
        self.trans = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("allowed", torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]]).bool())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trans = self.trans.masked_fill(~self.allowed, NEG_INF).log_softmax(-1)
        emit = self.emit(x).log_softmax(-1)  # (t, 4)
        alpha = emit[0] - math.log(4)  # (every state reachable: no column of all -inf)
        for t in range(1, x.shape[0]):
            alpha = torch.logsumexp(alpha[:, None] + trans, 0) + emit[t]
        return -torch.logsumexp(alpha, 0) + 0 * torch.logcumsumexp(emit[:, 0], 0).sum()


def hmm() -> Row:
    model = HMM()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(6, 3)
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: model(x)))


ROWS = {
    "mha_padding_averaged_weights": lambda: mha_padding(True),
    "mha_padding_per_head_weights": lambda: mha_padding(False),
    "sdpa_float_inf_mask": lambda: sdpa("float"),
    "sdpa_bool_mask": lambda: sdpa("bool"),
    "sdpa_is_causal": lambda: sdpa("causal"),
    "packed_lstm": lambda: packed("lstm"),
    "packed_lstm_proj_size": lambda: packed("proj"),
    "packed_bigru": lambda: packed("gru"),
    "ctc_zero_infinity_impossible_alignment": ctc_impossible,
    "cdist_logsumexp_over_inf": cdist_logsumexp,
    "beam_search_over_masked_log_softmax": beam_search_in_training,
    "beta_policy_without_validation": beta_policy,
    "jacobian_penalty_and_vjp": jacobian_vjp,
    "dp_sgd_vmap_grad": dp_sgd,
    "checkpoint_in_a_loop": lambda: checkpointed(False),
    "checkpoint_reentrant_in_a_loop": lambda: checkpointed(True),
    "gumbel_hard_over_banned_codes": gumbel_hard,
    "transformer_padding_then_fast_path_eval": transformer_padding,
    "hmm_forward_algorithm_log_space": hmm,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_sequence_and_attention_idioms_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)


def test_the_rows_really_meet_their_infinities() -> None:
    # (A row that stopped meeting its -inf would pass without testing anything.)
    torch.manual_seed(0)
    model = Prototypes()
    present = torch.rand(6, 5) > 0.4
    present[2] = False
    logits = (-torch.cdist(model.encode(torch.randn(6, 6)), model.protos)).masked_fill(~present, NEG_INF)
    assert torch.logsumexp(logits, -1)[2] == NEG_INF
    ctc = nn.CTCLoss(reduction="none")
    lp = torch.randn(3, 1, 5).log_softmax(-1)
    assert math.isinf(ctc(lp, torch.randint(1, 5, (1, 9)), torch.tensor([3]), torch.tensor([9])).item())
    logp = torch.distributions.Beta(torch.tensor(2.0), torch.tensor(2.0), validate_args=False).log_prob(
        torch.tensor([0.0, 1.0]))
    assert torch.isinf(logp).all()
    torch.manual_seed(0)
    assert torch.isinf(beam_search(Decoder())).sum() == 0  # beams start at -inf and are all filled by step 1
