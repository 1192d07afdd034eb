"""More healthy idioms an outside checker would try, five modes (issue 25; harness: test_calm16.py).

Deliberate infinities written other ways: top-k / top-p sampling by hand (``logits[remove] = -inf``, an index_put),
a causal mask built in the forward (``torch.full(-inf).triu(1)``), ``ctc_loss(zero_infinity=True)`` over an
impossible alignment, an MoE router masking full experts before its top-k, a constrained vocabulary
(log_softmax over -inf logits), a logsumexp over a fully masked row replaced by ``where``, BCE of a saturated
sigmoid, MultiheadAttention and TransformerEncoder with padding masks (the inference fast path included),
nn.Transformer with every mask and dropout, sdpa with ``is_causal`` and dropout.
More loop shapes: test_calm16_hooks.py.
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


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 8) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def sample_by_hand(top_k: int = 4, top_p: float = 0.8) -> Loop:
    """A training step, then sampling with top-k and top-p filtering written as in the HF examples."""
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 16, (2, 6))

    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(2):
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                seq = ids[:, :2]
                for _ in range(4):
                    logits = model(seq)[:, -1]
                    remove = logits < torch.topk(logits, top_k)[0][..., -1, None]
                    logits[remove] = NEG_INF
                    sorted_logits, order = torch.sort(logits, descending=True)
                    cumulative = sorted_logits.softmax(-1).cumsum(-1)
                    drop = cumulative > top_p
                    drop[..., 1:] = drop[..., :-1].clone()
                    drop[..., 0] = False
                    logits = logits.masked_fill(drop.scatter(1, order, drop), NEG_INF)
                    seq = torch.cat([seq, torch.multinomial(logits.softmax(-1), 1)], 1)
            out += [loss.detach(), seq]
        return out
    return Loop((model, opt), (model, opt), run)


class CausalInForward(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        t = x.shape[1]
        mask = torch.full((t, t), NEG_INF).triu(1)  # the mask built in the forward, each call
        return self.out(((q @ k.transpose(1, 2)) / 8 ** 0.5 + mask).softmax(-1) @ v)


def ctc(zero_infinity: bool = True) -> Loop:
    """A CTC head where one target is longer than its input: its loss is inf, ``zero_infinity`` makes it 0."""
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
    x = torch.randn(10, 3, 4)  # (time, batch, features)
    targets = torch.randint(1, 6, (3, 8))
    in_lens, tgt_lens = torch.tensor([10, 10, 4]), torch.tensor([3, 5, 8])  # the last: 8 labels in 4 frames

    def loss_of(m: nn.Module, step: int) -> torch.Tensor:
        return F.ctc_loss(m(x).log_softmax(-1), targets, in_lens, tgt_lens, zero_infinity=zero_infinity)  # ctc
    return sgd_loop(model, loss_of, lr=0.01)


class Router(nn.Module):
    """Top-2 routing over 4 experts; the experts at capacity are masked with -inf before the top-k."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).masked_fill(torch.tensor([False, True, False, False]), NEG_INF)
        weights, chosen = logits.topk(2, -1)
        weights = weights.softmax(-1)
        out = torch.zeros_like(x)
        for slot in range(2):
            for e, expert in enumerate(self.experts):
                hit = chosen[:, slot] == e
                if hit.any():
                    out[hit] += weights[hit, slot, None] * expert(x[hit])
        return out


def constrained_vocabulary() -> Loop:
    model = TinyLM()
    ids = torch.randint(0, 8, (3, 6))
    allowed = torch.arange(16) < 8  # only the first half of the vocabulary is legal here

    def loss_of(m: nn.Module, step: int) -> torch.Tensor:
        logp = m(ids).masked_fill(~allowed, NEG_INF).log_softmax(-1)
        return F.nll_loss(logp.flatten(0, 1), ids.roll(-1, 1).flatten())
    return sgd_loop(model, loss_of)


class MaskedLogSumExp(nn.Module):
    """A soft-max pooling over kept positions; a sequence with none kept gets 0 (its logsumexp is -inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        lse = self.lin(x).masked_fill(~keep[..., None], NEG_INF).logsumexp(1)
        return torch.where(keep.any(1, keepdim=True), lse, torch.zeros_like(lse))


def saturated_bce() -> Loop:
    """A classifier so confident its sigmoid is exactly 1.0 on some inputs: BCE clamps log(0) to -100."""
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(20.0)
    x, y = torch.randn(8, 4).abs() + 1, torch.tensor([1.0, 0.0] * 4)[:, None]
    return sgd_loop(model, lambda m, step: F.binary_cross_entropy(torch.sigmoid(m(x)), y), lr=1e-4)


class MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.attn(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=False)[0]


def _pad(b: int = 3, t: int = 5) -> torch.Tensor:
    pad = torch.zeros(b, t, dtype=torch.bool)
    pad[1, 3:] = True
    pad[2, 2:] = True
    return pad


def encoder_with_fast_path() -> Loop:
    """nn.TransformerEncoder trained with a padding mask, evaluated under inference_mode (its nested-tensor
    fast path) in the same cell."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs = [torch.randn(3, 5, 8) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        out = []
        for x in xs:
            model.train()
            loss = model(x, src_key_padding_mask=_pad()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.eval()
            with torch.inference_mode():
                out += [loss.detach(), model(x, src_key_padding_mask=_pad()).to_padded_tensor(0.0)
                        if model(x, src_key_padding_mask=_pad()).is_nested else model(x, src_key_padding_mask=_pad())]
        return out
    return Loop((model, opt), (model, opt), run)


VALUES = {
    "top-k-top-p-sampling-by-hand": sample_by_hand,
    "causal-mask-built-in-forward": lambda: sgd_loop(CausalInForward(), lambda m, s: m(torch.randn(2, 5, 8)).pow(2)
                                                     .mean()),
    "ctc-zero-infinity": ctc,
    "moe-router-masked-topk": lambda: sgd_loop(Router(), lambda m, s: m(torch.randn(6, 8)).pow(2).mean()),
    "constrained-vocabulary": constrained_vocabulary,
    "logsumexp-of-a-fully-masked-row": lambda: sgd_loop(
        MaskedLogSumExp(), lambda m, s: m(torch.randn(3, 5, 4), _pad(3, 5) | torch.tensor([0, 0, 1])[:, None].bool())
        .pow(2).mean()),
    "bce-of-a-saturated-sigmoid": saturated_bce,
    "multihead-attention-masks": lambda: sgd_loop(MHA(), lambda m, s: m(torch.randn(3, 5, 8), _pad()).pow(2).mean()),
    "transformer-encoder-fast-path": encoder_with_fast_path,
}


class Seq2Seq(nn.Module):
    """nn.Transformer with a causal target mask and padding masks on source, target and memory, dropout on."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(20, 16), nn.Linear(16, 20)
        self.tr = nn.Transformer(16, 2, 2, 2, 32, dropout=0.1, batch_first=True)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_pad: torch.Tensor, tgt_pad: torch.Tensor
                ) -> torch.Tensor:
        mask = self.tr.generate_square_subsequent_mask(tgt.shape[1])
        return self.out(self.tr(self.emb(src), self.emb(tgt), tgt_mask=mask, src_key_padding_mask=src_pad,
                                tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad, tgt_is_causal=True))


def seq2seq() -> Loop:
    model = Seq2Seq()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    src, tgt = torch.randint(1, 20, (3, 6)), torch.randint(1, 20, (3, 5))
    src_pad, tgt_pad = torch.zeros(3, 6, dtype=torch.bool), torch.zeros(3, 4, dtype=torch.bool)
    src_pad[1, 4:] = True
    tgt_pad[2, 3:] = True

    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(3):
            logits = model(src, tgt[:, :-1], src_pad, tgt_pad)
            loss = F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        model.eval()
        with torch.no_grad():
            out.append(model(src, tgt[:, :-1], src_pad, tgt_pad))
        model.train()
        return out
    return Loop((model, opt), (model, opt), run)


class CausalSDPA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0)
        return self.o(h.transpose(1, 2).reshape(x.shape))


VALUES |= {
    "nn-transformer-all-masks-dropout": seq2seq,
    "sdpa-is-causal-dropout": lambda: sgd_loop(CausalSDPA(), lambda m, s: m(torch.randn(2, 5, 16)).pow(2).mean()),
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", VALUES)
def test_deliberate_infinities_written_other_ways_are_calm(name: str, options: dict) -> None:
    assert_calm(VALUES[name], options)


@pytest.mark.parametrize("options", FIVE_MODES)
def test_ctc_without_zero_infinity_is_named_at_the_loss(options: dict) -> None:
    torch.manual_seed(0)
    loop = ctc(zero_infinity=False)
    report = raised(loop.run, *loop.targets, **options)
    assert (report.phase, report.module, report.step, report.posinf) == ("forward", None, 0, 1)
    assert (report.op, report.cause.label) == ("aten._ctc_loss.Tensor", "ctc-infeasible")
    assert report.source is not None and "F.ctc_loss(" in report.source.line
