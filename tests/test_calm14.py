"""No false alarm after session 14's changes (issue 25: nothing may get worse), in the five modes.

Healthy idioms that stress each change, each run unwatched and watched: no report, no event, no exception, the
outputs, parameters and gradients bit-identical, nothing left on the model:
1. hunt14: an ``amax``/``max`` over a row a mask hid entirely (-inf) is a producer where its -inf reaches an output;
   healthy code makes that -inf on purpose and replaces it (where, nan_to_num, clamp), or only logs it.
2. hot14a: the parameter check after a step reads one sum of the small CPU parameters (test_calm14_steps.py).
3. hot14b: the recorded lines kept per instruction (test_calm14_lines.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hf_models import bert, gpt2, llama, padded_batch, state, tokens, traces
from torch import nn
from torch.nn import functional as F
from watching import FIVE_MODES, raised

import nan_magic

NEG_INF = float("-inf")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)


Build = Callable[[], tuple[tuple, nn.Module, Callable[[], list[torch.Tensor]]]]


def assert_calm(build: Build, options: dict) -> None:
    """``build()`` (seeded inside) gives ``(targets, model, run)``: unwatched and watched runs must be identical.
    Benign events (a deliberate -inf mask seen entering) are recorded, never raised: no other event."""
    _targets, model, run = build()
    expected, expected_state = run(), state(model)
    expected_traces = traces(model)  # (after the run: a run may add a module or unfreeze one)
    targets, model, run = build()
    with nan_magic.watch(*targets, **options) as w:
        outputs = run()
    assert w.report is None and all(event.benign for event in w.events), (w.report, w.events)
    assert traces(model) == expected_traces
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(state(model), expected_state, strict=True))


def train(model: nn.Module, batch: Callable[[int], tuple], steps: int = 3, lr: float = 0.01) -> Build:
    """SGD on ``model(*batch(step)).pow(2).mean()``; outputs: the losses and model outputs."""
    def build():
        torch.manual_seed(0)
        m = model()
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr)

        def run() -> list[torch.Tensor]:
            torch.manual_seed(1)
            outputs = []
            for step in range(steps):
                out = m(*batch(step))
                loss = out.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                outputs += [loss.detach(), out.detach()]
            return outputs
        return (m, opt), m, run
    return build


def padded(step: int, b: int = 3, t: int = 5, d: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, mask)``: sequence 1 is all padding at every step, sequence 2 half."""
    x = torch.randn(b, t, d)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1] = False
    mask[2, t // 2:] = False
    return x, mask


# ---------------------------------------------------------------- 1. a max over a fully masked row, handled


class MaskedMaxPool(nn.Module):
    """Its output is -inf for a sequence that is all padding: its caller handles that (the intended contract)."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h.masked_fill(~mask[..., None], NEG_INF).amax(1)


class MaskedMax(nn.Module):
    """The same with ``torch.max(dim)`` (values and indices)."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h.masked_fill(~mask[..., None], NEG_INF).max(dim=1).values


class PoolThenClean(nn.Module):
    """A child max-pools (its output -inf on a padded sequence), the parent replaces that before the head."""

    def __init__(self, clean: str, pool: type[nn.Module] = MaskedMaxPool) -> None:
        super().__init__()
        self.enc, self.pool, self.head = nn.Linear(4, 4), pool(), nn.Linear(4, 1)
        self.clean = clean

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(self.enc(x), mask)
        if self.clean == "where":
            all_pad = ~mask.any(1, keepdim=True)
            pooled = torch.where(all_pad, torch.zeros_like(pooled), pooled)
        elif self.clean == "nan_to_num":
            pooled = torch.nan_to_num(pooled, neginf=0.0)
        elif self.clean == "clamp":
            pooled = pooled.clamp(min=-1.0)  # (-1e4 overflowed the loss by step 2, unwatched too)
        elif self.clean == "masked_fill":
            pooled = pooled.masked_fill(torch.isinf(pooled), 0.0)
        return self.head(pooled)


class InlinePoolThenClean(nn.Module):
    """The max and its cleaning in one forward: the -inf never reaches a module output."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooled = self.enc(x).masked_fill(~mask[..., None], NEG_INF).amax(1)
        return self.head(torch.where(torch.isfinite(pooled), pooled, torch.zeros_like(pooled)))


class LogsTheMax(nn.Module):
    """A max over the kept tokens used only for logging (a Python float, -inf for the padded sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.logged: list[list[float]] = []

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        with torch.no_grad():
            self.logged.append(h.masked_fill(~mask[..., None], NEG_INF).amax((1, 2)).tolist())
        return self.head((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1))


class RunningMax(nn.Module):
    """A running max from -inf over the steps of a sequence (beam scores, top-k): -inf where nothing was kept."""

    def __init__(self) -> None:
        super().__init__()
        self.score, self.head = nn.Linear(4, 1), nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = self.score(x).squeeze(-1).masked_fill(~mask, NEG_INF)
        best = torch.full_like(s[:, 0], NEG_INF)
        for t in range(s.shape[1]):
            best = torch.maximum(best, s[:, t])
        best = torch.where(torch.isneginf(best), torch.zeros_like(best), best)
        return self.head(best[:, None])


class CombineMasks(nn.Module):
    """Combines additive per-head masks (0 / -inf) into one by a max: -inf stays where every head hides a key. Its
    output is deliberately non-finite (a mask)."""

    def forward(self, masks: torch.Tensor) -> torch.Tensor:
        return masks.amax(0)


class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.combine, self.out = nn.Linear(4, 12), CombineMasks(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        w = (q @ k.transpose(-1, -2) + self.combine(masks)).softmax(-1)
        return self.out(w @ v)


def head_masks(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two causal masks, 0 / -inf: every query keeps itself, the union hides the future."""
    causal = torch.full((5, 5), NEG_INF).triu(1)
    return torch.randn(2, 5, 4), torch.stack([causal, causal.clone()])


class SdpaBool(nn.Module):
    """``scaled_dot_product_attention`` with a boolean mask where sequence 1 keeps no key."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(4, 12), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        keep = mask[:, None, :].expand(-1, x.shape[1], -1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(torch.nan_to_num(att) * mask[..., None])


class InferenceMaskedSoftmax(nn.Module):
    """Inference: a softmax over a fully -inf row (NaN), cleaned by ``masked_fill(.., 0)`` in the same forward."""

    def __init__(self) -> None:
        super().__init__()
        self.qk, self.out = nn.Linear(4, 8), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        hidden = ~mask[:, None, :].expand(-1, x.shape[1], -1)
        w = (q @ k.transpose(-1, -2)).masked_fill(hidden, NEG_INF).softmax(-1)
        w = w.masked_fill(hidden.all(-1, keepdim=True), 0.0)
        return self.out(w @ x)


def inference(model: Callable[[], nn.Module], batch: Callable[[int], tuple], steps: int = 3) -> Build:
    def build():
        torch.manual_seed(0)
        m = model().eval()

        def run() -> list[torch.Tensor]:
            torch.manual_seed(1)
            with torch.no_grad():
                return [m(*batch(step)) for step in range(steps)]
        return (m,), m, run
    return build


def hf_padded(which: str) -> Build:
    """A Hugging Face model trained on batches whose sequence 1 is all padding (attention mask 0, labels -100)."""
    def build():
        torch.manual_seed(0)
        m = {"bert": bert, "bert-eager": lambda: bert(attn_implementation="eager"),
             "gpt2-eager": lambda: gpt2(_attn_implementation="eager"),
             "llama-sdpa": lambda: llama(_attn_implementation="sdpa"),
             "llama-eager": lambda: llama(_attn_implementation="eager")}[which]()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

        def run() -> list[torch.Tensor]:
            torch.manual_seed(1)
            outputs = []
            for _ in range(2):
                batch = padded_batch(left=which.startswith("llama"))
                batch["attention_mask"][1] = 0
                batch["input_ids"][1] = 0
                if which.startswith("bert"):
                    batch["labels"] = torch.randint(0, 3, (3,))
                else:
                    batch["labels"][1] = -100
                out = m(**batch)
                opt.zero_grad()
                out.loss.backward()
                opt.step()
                outputs += [out.loss.detach(), out.logits.detach()]
            return outputs
        return (m, opt), m, run
    return build


def gpt2_generate_left_padded() -> tuple[tuple, nn.Module, Callable[[], list[torch.Tensor]]]:
    """generate(): greedy, beam search and top-k sampling (-inf filtered logits) from a left-padded prompt."""
    torch.manual_seed(0)
    m = gpt2().eval()
    ids = tokens(2, 5)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)

    def run() -> list[torch.Tensor]:
        kw = {"attention_mask": mask, "max_new_tokens": 4, "pad_token_id": 0}
        outputs = [m.generate(ids, do_sample=False, **kw), m.generate(ids, num_beams=2, do_sample=False, **kw)]
        torch.manual_seed(2)
        outputs.append(m.generate(ids, do_sample=True, top_k=5, **kw))
        return outputs
    return (m,), m, run


def loss_code_max(log_only: bool) -> Build:
    """The max over masked rows in the loop's loss code (no module): cleaned by a where, or only logged."""
    def build():
        torch.manual_seed(0)
        m = nn.Linear(4, 5)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)

        def run() -> list[torch.Tensor]:
            torch.manual_seed(1)
            outputs, logged = [], []
            for step in range(3):
                x, mask = padded(step, t=5)
                scores = m(x.mean(1)).masked_fill(~mask, NEG_INF)  # sequence 1: every position hidden
                top = scores.amax(-1)
                logged.append(top.tolist())  # -inf for sequence 1: a Python float, logged
                if log_only:
                    loss = scores.masked_fill(~mask, 0.0).pow(2).mean()
                else:
                    loss = torch.where(torch.isinf(top), torch.zeros_like(top), top).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                outputs += [loss.detach(), top.detach()]
            return outputs
        return (m, opt), m, run
    return build


HEALTHY_MASKS = {
    "max_pool_where": (train(lambda: PoolThenClean("where"), padded), ()),
    "max_pool_nan_to_num": (train(lambda: PoolThenClean("nan_to_num"), padded), ()),
    "max_pool_clamp": (train(lambda: PoolThenClean("clamp"), padded), ()),
    "max_pool_masked_fill": (train(lambda: PoolThenClean("masked_fill"), padded), ()),
    "torch_max_values_where": (train(lambda: PoolThenClean("where", MaskedMax), padded), ()),
    "inline_max_pool_where": (train(InlinePoolThenClean, padded), ()),
    "max_for_logging_only": (train(LogsTheMax, padded), ()),
    "loss_code_max_over_masked_rows_where": (loss_code_max(False), ()),
    "loss_code_max_over_masked_rows_logged": (loss_code_max(True), ()),
    "running_max_from_neg_inf": (train(RunningMax, padded), ()),
    "mask_module_amax_of_float_masks": (train(MaskedAttention, head_masks), ()),
    "sdpa_bool_mask_fully_masked_row": (train(SdpaBool, padded), ()),
    "inference_masked_softmax_then_masked_fill": (inference(InferenceMaskedSoftmax, padded), ()),
    "bert_a_sequence_all_padding": (hf_padded("bert"), ()),
    "bert_eager_a_sequence_all_padding": (hf_padded("bert-eager"), ()),
    "gpt2_eager_a_sequence_all_padding": (hf_padded("gpt2-eager"), ()),
    "llama_sdpa_left_padding_a_row_all_padding": (hf_padded("llama-sdpa"), ()),
    "llama_eager_left_padding_a_row_all_padding": (hf_padded("llama-eager"), ()),
    "gpt2_generate_left_padded_beams_top_k": (gpt2_generate_left_padded, ()),
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", [pytest.param(name, marks=marks) for name, (_, marks) in HEALTHY_MASKS.items()])
def test_a_max_over_a_fully_masked_row_that_the_code_handles_is_calm(name: str, options: dict) -> None:
    assert_calm(HEALTHY_MASKS[name][0], options)


# ---------------------------------------------------------------- 1'. the broken twins: the cleaning left out


class InlineForgetsOnce(InlinePoolThenClean):
    """The inline max pool, its cleaning dropped at step 2: the head makes NaN of the -inf the max made."""

    step = 0

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.step != 2:
            return super().forward(x, mask)
        pooled = self.enc(x).masked_fill(~mask[..., None], NEG_INF).amax(1)  # producer: inline max
        return self.head(pooled)


class PoolForgetsOnce(PoolThenClean):
    """The pooling child, its parent's ``nan_to_num`` dropped at step 2."""

    step = 0

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.clean = "none" if self.step == 2 else "nan_to_num"
        return super().forward(x, mask)


def _forgets(model: nn.Module) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for step in range(4):
            model.step = step
            loss = model(*padded(step)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model, opt, run


#: A fully masked row's max stays benign where it is made, so the healthy idioms above stay calm; a broken twin names
#: the max once a consumer makes a new kind of its -inf (localize/ops/origins.Picked; gaps22: the consumer was named).
#: The per-module watch judges a pooling child's output benign by a replay of that call alone: its consumer's NaN is
#: named by a replay of the call around both (replay/outward.replay_around_a_pick; gaps23: the head's addmm was).


@pytest.mark.parametrize("options", FIVE_MODES)
def test_an_inline_max_pool_is_named_where_its_cleaning_is_left_out(options: dict) -> None:
    torch.manual_seed(0)
    model, opt, run = _forgets(InlineForgetsOnce())
    report = raised(run, model, opt, **options)
    assert (report.phase.value, report.module, report.step, report.op) == ("forward", "", 2, "aten.amax.default")
    assert report.source is not None and "producer: inline max" in report.source.line


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_pooling_child_is_named_where_its_parent_leaves_out_the_cleaning(options: dict) -> None:
    torch.manual_seed(0)
    model, opt, run = _forgets(PoolForgetsOnce("nan_to_num"))
    report = raised(run, model, opt, **options)
    assert (report.phase.value, report.module, report.module_type, report.step) == ("forward", "pool",
                                                                                    "MaskedMaxPool", 2)
    assert report.op == "aten.amax.default" and "amax(1)" in report.source.line


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_max_over_masked_rows_in_the_loss_code_is_named_where_the_where_is_left_out(options: dict) -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 5)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)

    def run() -> None:
        for step in range(4):
            x, mask = padded(step, t=5)
            top = m(x.mean(1)).masked_fill(~mask, NEG_INF).amax(-1)  # producer: loss max
            loss = (top if step == 2 else torch.where(torch.isinf(top), torch.zeros_like(top), top)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, m, opt, **options)
    assert (report.phase.value, report.module, report.step, report.op) == ("forward", None, 2, "aten.amax.default")
    assert report.source is not None and report.source.line.endswith("# producer: loss max")
