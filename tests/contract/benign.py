"""Healthy idioms and benign events: deliberate infinities (masks) and GradScaler skips.

A float attention mask holding -inf, passed as an argument or held as a
buffer, is benign while what consumes it stays finite; the consumer that
turns it into a NaN (softmax over a fully masked row) is the producer. A
step that a GradScaler skips is benign whether or not the scaler was passed
to ``watch``; a scale that keeps collapsing is not. Near-misses that must
stay events: an overflowed +inf batch feature, a mask holding a NaN.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from contract import Case, Expect, Scenario

STEPS = 30


def causal_mask(size: int) -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(size)


def _train(model: nn.Module, loss_of, steps: int = STEPS, lr: float = 0.01):
    """An SGD loop whose result is every loss and the final parameters (compared bit for bit)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        losses = []
        for step in range(steps):
            loss = loss_of(step)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, [p.detach().clone() for p in model.parameters()]

    return opt, run


# -- masks as arguments ---------------------------------------------------------------


def _transformer_causal_kwarg() -> Scenario:
    torch.manual_seed(0)
    model = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(4, 6, 16), torch.randn(4, 5, 16)
    src_padding = torch.zeros(4, 6, dtype=torch.bool)
    src_padding[:, 4:] = True
    mask = causal_mask(5)

    def loss_of(step: int) -> torch.Tensor:
        out = model(src, tgt, tgt_mask=mask, src_key_padding_mask=src_padding,
                    memory_key_padding_mask=src_padding)
        return out.pow(2).mean()

    opt, run = _train(model, loss_of)
    return Scenario((model, opt), run)


def _transformer_masks_positional() -> Scenario:
    """``model(src, tgt, src_mask, tgt_mask)``: masks named by forward's signature, built fresh each step."""
    torch.manual_seed(0)
    model = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(4, 5, 16), torch.randn(4, 5, 16)

    def loss_of(step: int) -> torch.Tensor:
        return model(src, tgt, causal_mask(5), causal_mask(5)).pow(2).mean()

    _opt, run = _train(model, loss_of)
    return Scenario((model,), run)


class SelfAttention(nn.Module):
    """Attention with an additive mask argument that is not named mask (``bias``); softmax in its own code."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / 4.0 + bias
        weights = scores.softmax(-1)  # producer: fully masked softmax
        return self.out(weights @ v)


def _mha_and_sdpa_with_masks() -> Scenario:
    """nn.MultiheadAttention's attn_mask, F.scaled_dot_product_attention's, and a hand-written attention."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
            self.proj = nn.Linear(16, 16)
            self.attn = SelfAttention()

        def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
            h = self.mha(x, x, x, attn_mask=causal, need_weights=False)[0]
            h = F.scaled_dot_product_attention(self.proj(h), h, h, attn_mask=causal)
            return self.attn(h, causal)

    model = Model()
    x, mask = torch.randn(3, 5, 16), causal_mask(5)
    _opt, run = _train(model, lambda step: model(x, mask).pow(2).mean())
    return Scenario((model,), run)


# -- masks held as buffers ------------------------------------------------------------


class MaskedScores(nn.Module):
    """Returns scores with a -inf mask buffer added: a mask-like output, passed on to its parent's softmax."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("causal", causal_mask(size))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-1, -2) + self.causal


class Softmax(nn.Module):
    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.softmax(-1)  # producer: softmax of a fully masked row


class BufferAttention(nn.Module):
    def __init__(self, size: int = 5, width: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.scores = MaskedScores(size)
        self.softmax = Softmax()
        self.mha = nn.MultiheadAttention(width, 2, batch_first=True)
        self.register_buffer("mask", causal_mask(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.softmax(self.scores(self.q(x), self.k(x)))
        h = self.mha(x, x, x, attn_mask=self.mask, need_weights=False)[0]
        return weights @ h


def _mask_buffers() -> Scenario:
    torch.manual_seed(0)
    model = BufferAttention()
    x = torch.randn(3, 5, 16)
    opt, run = _train(model, lambda step: model(x).pow(2).mean())
    return Scenario((model, opt), run)


def _fully_masked_buffer_row() -> Scenario:
    """A mask buffer with a row that hides every key: the softmax that consumes it makes NaN."""
    torch.manual_seed(0)
    model = BufferAttention()
    model.scores.causal[2] = float("-inf")
    x = torch.randn(3, 5, 16)
    return Scenario((model,), lambda: model(x))


def _fully_masked_argument_row() -> Scenario:
    torch.manual_seed(0)
    model = SelfAttention()
    mask = causal_mask(5)
    mask[3] = float("-inf")
    x = torch.randn(2, 5, 16)
    return Scenario((model,), lambda: model(x, mask))


# -- what must stay an event ----------------------------------------------------------


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(extra)


def _overflowed_feature() -> Scenario:
    """A batch feature that overflowed to +inf among ordinary values: data, not a mask."""
    torch.manual_seed(0)
    model = TwoInputs()
    x, extra = torch.randn(3, 4), torch.randn(3, 4)
    extra[1, 2] = float("inf")
    return Scenario((model,), lambda: model(x, extra))


def _log_of_binary_batch() -> Scenario:
    """``log`` of a 0/1 batch gives 0/-inf, a mask's values, as the first argument: still data."""
    torch.manual_seed(0)
    model = TwoInputs()
    batch = torch.randint(0, 2, (3, 4)).float().log()
    batch[0, 0] = float("-inf")
    return Scenario((model,), lambda: model(batch, torch.randn(3, 4)))


def _mask_with_nan() -> Scenario:
    """A mask argument holding a NaN: NaN is never deliberate."""
    torch.manual_seed(0)
    model = SelfAttention()
    mask = causal_mask(5)
    mask[0, 3] = float("nan")
    return Scenario((model,), lambda: model(torch.randn(2, 5, 16), mask))


def _all_inf_named_mask() -> Scenario:
    """A tensor named as a mask but infinite everywhere hides nothing deliberately."""
    torch.manual_seed(0)
    model = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    return Scenario((model,), lambda: model(src, tgt, tgt_mask=torch.full((4, 4), float("-inf"))))


# -- GradScaler not passed --------------------------------------------------------------


def _amp(init_scale: float, steps: int, pass_optimizer: bool, guarded: bool = False) -> Scenario:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)]
    if guarded:
        layers = [nn.Linear(16, 16), GuardedExp(), nn.Linear(16, 4)]
    model = nn.Sequential(*layers)
    if guarded:
        with torch.no_grad():
            model[0].bias.fill_(100.0)  # exp overflows in the branch not taken: NaN gradients at any scale
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
        losses = []
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
        return losses, [p.detach().clone() for p in model.parameters()], scaler.get_scale()

    return Scenario((model, opt) if pass_optimizer else (model,), run)


class GuardedExp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x < 20, torch.exp(x), x)  # producer: guarded exp


# -- healthy idioms: silent and bit-identical over STEPS training steps ------------------


def _bf16_autocast() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))

    def loss_of(step: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(model(x), y)

    opt, run = _train(model, loss_of, lr=0.05)
    return Scenario((model, opt), run)


def _batchnorm_and_dropout() -> Scenario:
    """BatchNorm statistics and dropout masks: the watch must draw no random number and touch no buffer."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout2d(0.2), nn.Flatten(),
        nn.Dropout(0.3), nn.Linear(4 * 6 * 6, 3), nn.BatchNorm1d(3),
    )
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 3, (8,))

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(STEPS):
            model.train(step % 10 != 9)  # an eval pass now and then: running statistics in use
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            if model.training:
                loss.backward()
                opt.step()
            losses.append(loss.detach())
        return losses, [t.detach().clone() for t in model.state_dict().values()]

    return Scenario((model,), run)


def _accumulation_and_clipping() -> Scenario:
    """Gradients accumulated over three micro-batches, clipped with clip_grad_norm_, then Adam."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(3)]

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        norms = []
        for _ in range(STEPS):
            opt.zero_grad()
            for x, y in batches:
                (F.mse_loss(model(x), y) / len(batches)).backward()
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5))
            opt.step()
        return norms, [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


def _hugging_face(kind: str, attention: str) -> Scenario:
    """A tiny GPT-2 or BERT built from a config (random init, nothing downloaded), padded batches."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = {"vocab_size": 40, "attn_implementation": attention, "bos_token_id": 1, "eos_token_id": 2}
    ids = torch.randint(3, 40, (2, 8))
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[1, 5:] = 0
    if kind == "gpt2":
        config = transformers.GPT2Config(n_positions=8, n_embd=16, n_layer=1, n_head=2, pad_token_id=0, **common)
        model = transformers.GPT2LMHeadModel(config)
        labels = ids.masked_fill(attention_mask == 0, -100)
    else:
        config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=8, **common)
        model = transformers.BertForSequenceClassification(config)
        labels = torch.tensor([0, 1])
    assert model.config._attn_implementation == attention

    def loss_of(step: int) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss

    opt, run = _train(model, loss_of, lr=0.05)
    return Scenario((model, opt), run)


_SOFTMAX_OP = "aten._softmax.default"

CASES = [
    Case("transformer_causal_mask_and_padding_kwargs", _transformer_causal_kwarg, None, benign=1),
    Case("transformer_masks_positional_fresh_each_step", _transformer_masks_positional, None, benign=2,
         note="two places (src_mask, tgt_mask), one benign event each per watch"),
    Case("mha_sdpa_and_own_attention_with_an_unnamed_mask", _mha_and_sdpa_with_masks, None, benign=1),
    Case("mask_buffers_added_in_a_child_and_given_to_mha", _mask_buffers, None, benign=1,
         note="the buffer 'causal' reaches a module output (one benign event); 'mask' only feeds MHA"),
    Case("fully_masked_row_of_a_mask_buffer", _fully_masked_buffer_row,
         Expect("forward", "softmax", "Softmax", op=_SOFTMAX_OP, marker="softmax of a fully masked row",
                kinds=frozenset({"nan"}), benign_events=1)),
    Case("fully_masked_row_of_a_mask_argument", _fully_masked_argument_row,
         Expect("forward", "", "SelfAttention", op=_SOFTMAX_OP, marker="fully masked softmax",
                kinds=frozenset({"nan"}), benign_events=1)),
    Case("overflowed_batch_feature_is_data", _overflowed_feature,
         Expect("data", "", "TwoInputs", kinds=frozenset({"+inf"}), op=None)),
    Case("log_of_a_binary_batch_is_data", _log_of_binary_batch,
         Expect("data", "", "TwoInputs", kinds=frozenset({"-inf"}), op=None)),
    Case("mask_holding_a_nan_is_data", _mask_with_nan,
         Expect("data", "", "SelfAttention", kinds=frozenset({"nan", "-inf"}), op=None)),
    Case("all_infinite_mask_is_data", _all_inf_named_mask,
         Expect("data", "", "Transformer", kinds=frozenset({"-inf"}), op=None)),
    # From a scale of 2**24 the scaler skips the first 5 steps (scale 2**19 after them), each a benign event.
    Case("grad_scaler_unpassed_skips_are_benign", lambda: _amp(2.0**24, STEPS, pass_optimizer=True), None,
         benign=5),
    Case("grad_scaler_and_optimizer_unpassed", lambda: _amp(2.0**24, STEPS, pass_optimizer=False), None,
         benign=5),
    Case("grad_scaler_unpassed_collapse_raises", lambda: _amp(2.0**16, 40, True, guarded=True),
         Expect("backward", "1", "GuardedExp", cause="grad-scaler-collapse", benign_events=15,
                op="aten.mul.Tensor", marker="guarded exp"),
         modes=("default", "defer", "full"),
         note="the last collapsed step's producer: exp's +inf times a zero gradient in its backward. "
              "ops: raises at the forward exp that torch.where discards (issue 15 item 11, the ops worktree's)"),
    Case("bf16_autocast", _bf16_autocast, None, benign=0),
    Case("batchnorm_and_dropout_with_eval_passes", _batchnorm_and_dropout, None, benign=0),
    Case("gradient_accumulation_and_clip_grad_norm", _accumulation_and_clipping, None, benign=0),
    Case("gpt2_eager", lambda: _hugging_face("gpt2", "eager"), None, benign=0),
    Case("gpt2_sdpa", lambda: _hugging_face("gpt2", "sdpa"), None, benign=0),
    Case("bert_eager", lambda: _hugging_face("bert", "eager"), None, benign=0),
    Case("bert_sdpa", lambda: _hugging_face("bert", "sdpa"), None, benign=0),
]
