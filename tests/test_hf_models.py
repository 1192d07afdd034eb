"""Hugging Face ``transformers`` models, trained the way users train them: silent when healthy, right about where.

The models are tiny (2 layers, width 32, vocabulary 128) and built from configs with random weights: no downloads.
"""

from __future__ import annotations

import os

import pytest
import torch
from hf_models import IDIOMS, WIDTH, bert, gpt2, idiom, llama, padded_batch, state, t5, tokens, traces, vit
from torch import nn
from transformers import AttentionInterface
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward
from watching import FIVE_MODES, raised

import nan_magic

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)


#: Each idiom's unwatched outputs and final state, computed once for its five modes.
_UNWATCHED: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", IDIOMS)
def test_a_healthy_model_is_silent_untouched_and_bit_identical(name: str, options: dict) -> None:
    if name not in _UNWATCHED:
        model, opt, run = idiom(name)
        _UNWATCHED[name] = run(), state(model)
    expected, expected_state = _UNWATCHED[name]

    model, opt, run = idiom(name)
    before = traces(model)
    with nan_magic.watch(model, *([] if opt is None else [opt]), **options) as w:
        outputs = run()
    assert w.report is None and w.events == []
    assert traces(model) == before  # no hook, attribute or wrapped forward of ours left
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(torch.equal(got, want) for got, want in zip(state(model), expected_state, strict=True))
    if name.startswith("gpt2"):  # the tied lm_head stays tied
        assert model.lm_head.weight is model.transformer.wte.weight


# ---------------------------------------------------------------- incidents: each report against the known truth


def _loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list[dict], before_step=None) -> None:
    for step, batch in enumerate(batches):
        if before_step is not None:
            before_step(step)
        out = model(**batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()  # the optimizer's line


def _lm_batches() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": (ids := tokens()), "labels": ids} for _ in range(2)]


def _neg_inf_mask(impl: str = "eager"):
    model = gpt2(_attn_implementation=impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = tokens(2, 6)

    def run() -> None:
        for step in range(2):
            mask = torch.full((2, 1, 6, 6), float("-inf")).triu(1)  # the user's causal mask: -inf, not finfo.min
            if step == 1:
                mask[1] = float("-inf")  # the second sequence is all padding: every key masked
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    return (model, opt), run


def _fp16_attention_scores():
    model = gpt2(_attn_implementation="eager").half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def before(step: int) -> None:
        if step == 1:
            with torch.no_grad():  # q and k near 100: their dot product over 8 dims passes 65504
                model.transformer.h[0].attn.c_attn.weight.normal_(0, 20)
    return (model, opt), lambda: _loop(model, opt, _lm_batches(), before)


def _fp16_llama_mlp():
    model = llama().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def before(step: int) -> None:
        if step == 1:
            with torch.no_grad():  # gate and up near 300 each: SiLU(gate) * up passes 65504
                model.model.layers[1].mlp.gate_proj.weight.normal_(0, 30)
                model.model.layers[1].mlp.up_proj.weight.normal_(0, 30)
    return (model, opt), lambda: _loop(model, opt, _lm_batches(), before)


def _fp16_gpt2_mlp():
    model = gpt2().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def before(step: int) -> None:
        if step == 1:
            with torch.no_grad():  # gelu_new's x**3 overflows and tanh absorbs it; then c_proj's sum overflows
                model.transformer.h[1].mlp.c_fc.weight.normal_(0, 30)
                model.transformer.h[1].mlp.c_proj.weight.normal_(0, 30)
    return (model, opt), lambda: _loop(model, opt, _lm_batches(), before)


def _rmsnorm_eps0():
    model = llama(rms_norm_eps=0.0)  # the padding row of the embedding is zero: rsqrt(0 + 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [{"input_ids": (ids := tokens()), "labels": ids}, padded_batch()]  # padding first at step 1
    return (model, opt), lambda: _loop(model, opt, batches)


def _rope_theta0():
    model = llama(rope_parameters={"rope_type": "default", "rope_theta": 0.0})  # inv_freq = 1 / 0**x at __init__
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return (model, opt), lambda: _loop(model, opt, _lm_batches())


def _labels_all_ignored():
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = tokens()
    batches = [{"input_ids": ids, "labels": ids}, {"input_ids": ids, "labels": torch.full_like(ids, -100)}]
    return (model, opt), lambda: _loop(model, opt, batches)


def _inf_lr_on_the_head():
    model = bert()
    for p in model.bert.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batches = [padded_batch() for _ in range(2)]
    for batch in batches:
        batch["labels"] = torch.randint(0, 3, (3,))

    def before(step: int) -> None:
        if step == 1:
            opt.param_groups[0]["lr"] = float("inf")  # a scheduler gone wrong
    return (model, opt), lambda: _loop(model, opt, batches, before)


def _custom_loss_on_logits():
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = tokens()

    def run() -> None:
        for temperature in (1.0, 1e-4):
            logits = model(input_ids=ids).logits
            probs = torch.softmax(logits / temperature, dim=-1)
            loss = -torch.log(probs).mean()  # the user's cross entropy: log(0) where the softmax underflowed
            opt.zero_grad()
            loss.backward()
            opt.step()
    return (model, opt), run


class _LogActivation(nn.Module):
    """A user's activation, swapped into GPT-2's MLP: log(x - 10) when told."""

    def __init__(self) -> None:
        super().__init__()
        self.fire = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 10) if self.fire else torch.tanh(x)  # producer: log when told


def _checkpointed_block():
    model = gpt2()
    model.gradient_checkpointing_enable()
    model.train()
    act = model.transformer.h[1].mlp.act = _LogActivation()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def before(step: int) -> None:
        act.fire = step == 1
    return (model, opt), lambda: _loop(model, opt, [padded_batch() for _ in range(2)], before)


class _NormHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        r = self.proj(h)
        return torch.sqrt((r * r).sum(-1))  # a zero vector: sqrt'(0) is inf, times 2 * r = 0 in the backward


class _BertWithNormHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = bert().bert
        self.head = _NormHead()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(input_ids=input_ids, attention_mask=attention_mask).pooler_output)


def _backward_only():
    model = _BertWithNormHead()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run() -> None:
        for step in range(2):
            if step == 1:
                with torch.no_grad():  # a head initialised to zero
                    model.head.proj.weight.zero_()
                    model.head.proj.bias.zero_()
            batch = padded_batch()
            loss = (model(batch["input_ids"], batch["attention_mask"]) - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return (model, opt), run


def _adamw_on_fp16_weights():
    model = llama().half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # eps=1e-8 is 0 in float16: 0 / 0 for unused rows
    return (model, opt), lambda: _loop(model, opt, _lm_batches())


class _SqrtAbs(nn.Module):
    """|x| written by hand, swapped into GPT-2's MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)  # sqrt'(0) is inf, times 2 * x = 0 in the backward


def _checkpointed_block_backward():
    model = gpt2()
    model.gradient_checkpointing_enable()
    model.train()
    mlp = model.transformer.h[1].mlp
    mlp.act = _SqrtAbs()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def before(step: int) -> None:
        if step == 1:
            with torch.no_grad():  # the MLP's input projection zeroed: every activation input is 0
                mlp.c_fc.weight.zero_()
                mlp.c_fc.bias.zero_()
    return (model, opt), lambda: _loop(model, opt, [padded_batch() for _ in range(2)], before)


class _LogOnDecode(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 10) if x.shape[1] == 1 else torch.tanh(x)  # NaN from the first decoding step on


def _generate():
    model = gpt2().eval()
    model.transformer.h[1].mlp.act = _LogOnDecode()
    prompt = tokens(2, 4)
    return (model,), lambda: model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)


def _pixel_values_by_keyword():
    model = vit()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images = [torch.rand(2, 3, 16, 16) for _ in range(2)]
    images[1][1] = 0.5  # a blank image: its std is 0
    labels = torch.tensor([0, 1])

    def run() -> None:
        for raw in images:
            pixel_values = (raw - raw.mean(dim=(1, 2, 3), keepdim=True)) / raw.std(dim=(1, 2, 3), keepdim=True)
            out = model(pixel_values=pixel_values, labels=labels)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    return (model, opt), run


def _fp16_t5_feed_forward():
    model = t5().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    batch = {"input_ids": tokens(2, 8), "labels": tokens(2, 5)}
    dense = model.encoder.block[0].layer[-1].DenseReluDense

    def before(step: int) -> None:
        if step == 1:
            with torch.no_grad():  # wi then wo, each about 30 times too large: wo's sum passes 65504
                dense.wi.weight.normal_(0, 30)
                dense.wo.weight.normal_(0, 30)
    return (model, opt), lambda: _loop(model, opt, [batch, batch], before)


def _attention_output_divided_by_zero(module, query, key, value, attention_mask, **kwargs):
    """A user's attention function (``AttentionInterface``): GPT-2's eager attention, its output renormalised by
    hand, by a norm that is 0 where every value is 0. A NaN made on an attention output was once named
    ``transformer.h.0``, not its ``attn``, in a probe (session 13)."""
    attn_output, attn_weights = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    attn_output = attn_output / attn_output.norm(dim=-1, keepdim=True)  # producer: the attention output
    return attn_output, attn_weights


AttentionInterface.register("nan_magic_test_output_norm", _attention_output_divided_by_zero)


def _attention_output():
    model = gpt2(_attn_implementation="nan_magic_test_output_norm")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attn = model.transformer.h[0].attn

    def before(step: int) -> None:
        if step == 1:
            with torch.no_grad():  # the value projection zeroed: every value, and so the attention output, is 0
                attn.c_attn.weight[:, 2 * WIDTH:].zero_()
                attn.c_attn.bias[2 * WIDTH:].zero_()
    return (model, opt), lambda: _loop(model, opt, _lm_batches(), before)


_HF = "transformers"
_HERE = "test_hf_models.py"
#: case: (build, phase, step, module, op, (file, text of the line)); a ``_HF`` file is in transformers' source.
INCIDENTS = {
    "gpt2-user-mask-neg-inf": (_neg_inf_mask, "forward", 1, "transformer.h.0.attn", "aten._softmax.default",
                               ("modeling_gpt2.py", "softmax(attn_weights")),
    "gpt2-fp16-attention-scores": (_fp16_attention_scores, "forward", 1, "transformer.h.0.attn", "aten.bmm.default",
                                   ("modeling_gpt2.py", "torch.matmul(query, key.transpose(-1, -2))")),
    "llama-fp16-mlp": (_fp16_llama_mlp, "forward", 1, "model.layers.1.mlp", "aten.mul.Tensor",
                       ("modeling_llama.py", "self.act_fn(self.gate_proj(x)) * self.up_proj(x)")),
    "gpt2-fp16-mlp": (_fp16_gpt2_mlp, "forward", 1, "transformer.h.1.mlp.c_proj", "aten.addmm.default",
                      ("pytorch_utils.py", "torch.addmm(")),
    "llama-rmsnorm-eps0": (_rmsnorm_eps0, "forward", 1, "model.layers.0.input_layernorm", "aten.rsqrt.default",
                           ("modeling_llama.py", "torch.rsqrt(variance + self.variance_epsilon)")),
    "llama-rope-theta0": (_rope_theta0, "forward", 0, "model.rotary_emb", None, None),
    "gpt2-labels-all-ignored": (_labels_all_ignored, "forward", 1, "", "aten.nll_loss_forward.default",
                                ("loss_utils.py", "nn.functional.cross_entropy(")),
    "bert-frozen-inf-lr": (_inf_lr_on_the_head, "optimizer", 1, "classifier", "aten.mul_.Tensor",
                           (_HERE, "opt.step()  # the optimizer's line")),
    "gpt2-custom-loss-on-logits": (_custom_loss_on_logits, "forward", 1, None, "aten.log.default",
                                   (_HERE, "loss = -torch.log(probs).mean()")),
    "gpt2-checkpointed-block": (_checkpointed_block, "forward", 1, "transformer.h.1.mlp.act", "aten.log.default",
                                (_HERE, "return torch.log(x - 10) if self.fire")),
    "bert-backward-only-sqrt": (_backward_only, "backward", 1, "head", "aten.div.Tensor",
                                (_HERE, "return torch.sqrt((r * r).sum(-1))")),
    "llama-adamw-fp16-weights": (_adamw_on_fp16_weights, "optimizer", 0, "model.embed_tokens",
                                 "aten.addcdiv_.default", (_HERE, "opt.step()  # the optimizer's line")),
    "gpt2-checkpointed-block-backward": (_checkpointed_block_backward, "backward", 1, "transformer.h.1.mlp.act",
                                         "aten.div.Tensor", (_HERE, "return torch.sqrt(x * x)")),
    "gpt2-generate": (_generate, "forward", 1, "transformer.h.1.mlp.act", "aten.log.default",
                      (_HERE, "return torch.log(x - 10) if x.shape[1] == 1")),
    "t5-fp16-feed-forward": (_fp16_t5_feed_forward, "forward", 1, "encoder.block.0.layer.1.DenseReluDense.wo",
                             "aten.mm.default", ("modeling_t5.py", "hidden_states = self.wo(hidden_states)")),
    "gpt2-attention-output": (_attention_output, "forward", 1, "transformer.h.0.attn", "aten.div.Tensor",
                              (_HERE, "attn_output = attn_output / attn_output.norm(dim=-1, keepdim=True)")),
    "vit-pixel-values-by-keyword": (_pixel_values_by_keyword, "data", 1, "", "aten.div.Tensor",
                                    (_HERE, "pixel_values = (raw - raw.mean(dim=(1, 2, 3), keepdim=True))")),
}

#: (case, mode) pairs that do not work yet, and why.
_NOT_YET: dict[tuple[str, str], str] = {}


def _incident_params():
    for case in INCIDENTS:
        for mode in FIVE_MODES:
            why = _NOT_YET.get((case, mode.id))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            yield pytest.param(case, mode.values[0], id=f"{case}-{mode.id}", marks=marks)


@pytest.mark.parametrize(("case", "options"), list(_incident_params()))
def test_an_incident_is_named_where_it_happened(case: str, options: dict) -> None:
    build, phase, step, module, op, line = INCIDENTS[case]
    torch.manual_seed(0)
    targets, run = build()
    before = traces(targets[0])
    report = raised(run, *targets, **options)
    assert (report.phase, report.step, report.module, report.op) == (phase, step, module, op)
    assert report.nan + report.posinf + report.neginf > 0
    if line is None:  # made before the watch: named by the tensor the module read
        assert report.source is None
        assert (report.tensor.role.value, report.tensor.name) == ("buffer", "model.rotary_emb.inv_freq")
        assert report.cause.label == "parameter-already-nonfinite"
    else:
        file, text = line
        assert report.source is not None and report.source.filename.endswith(file)
        assert text in report.source.line
        if file != _HERE:
            assert f"{os.sep}{_HF}{os.sep}" in report.source.filename
    assert traces(targets[0]) == before


def test_a_user_mask_with_neg_inf_under_sdpa_stays_finite_and_the_watch_silent() -> None:
    """torch's CPU sdpa gives a fully masked row zeros, not NaN: nothing to report, no false alarm."""
    torch.manual_seed(0)
    (model, opt), run = _neg_inf_mask("sdpa")
    for options in ({}, {"mode": "full"}):
        with nan_magic.watch(model, opt, **options) as w:
            run()
        assert w.report is None and all(event.benign for event in w.events)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


@pytest.mark.parametrize("options", FIVE_MODES)
def test_replays_leave_the_users_kv_cache_and_outputs_as_unwatched(options: dict) -> None:
    """A replay of GPT-2's attention (the per-module watch's) ran on the DynamicCache the call had appended to, and
    appended again: the user's cache came back with every key twice. It is put back, and the outputs are the same."""
    torch.manual_seed(0)
    model = gpt2(_attn_implementation="eager").eval()
    ids = tokens(2, 6)
    mask = torch.full((2, 1, 6, 6), float("-inf")).triu(1)
    mask[1] = float("-inf")  # an all-masked sequence: softmax gives NaN

    def run():
        return model(input_ids=ids, attention_mask=mask, use_cache=True)

    expected = run()
    with nan_magic.watch(model, on_detect="log", **options) as w:
        got = run()
    where = ("forward", "transformer.h.0.attn", "aten._softmax.default")
    assert (w.report.phase, w.report.module, w.report.op) == where
    assert _same(got.logits, expected.logits)
    for layer, want in zip(got.past_key_values.layers, expected.past_key_values.layers, strict=True):
        assert _same(layer.keys, want.keys) and _same(layer.values, want.values)


def _sqrt_value_attention(module, query, key, value, attention_mask, **kwargs):
    """A user's attention function (``AttentionInterface``): |value| by hand, then GPT-2's eager attention."""
    value = torch.sqrt(value * value)  # sqrt'(0) is inf, times 2 * value = 0 in the backward
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("nan_magic_test_sqrt_value", _sqrt_value_attention)


def _backward_nan_with_cache() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = gpt2(_attn_implementation="nan_magic_test_sqrt_value").eval()
    attn = model.transformer.h[0].attn
    with torch.no_grad():  # the value projection zeroed: every value is 0
        attn.c_attn.weight[:, 2 * WIDTH:].zero_()
        attn.c_attn.bias[2 * WIDTH:].zero_()
    return model, torch.optim.SGD(model.parameters(), lr=0.0)


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_backward_nan_with_a_kv_cache_is_named_and_the_cache_left_as_unwatched(options: dict) -> None:
    """A backward replay of an attention call must not append to the user's DynamicCache (as the forward replay
    once did). The full mode does not replay such a module call (its held arguments would hold the cache): it names
    the op from the step's kept top-level call (localize/replay/per_call.py)."""
    ids = tokens(2, 6)

    def run(model: nn.Module, opt: torch.optim.Optimizer):
        out = model(input_ids=ids, labels=ids, use_cache=True)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        return out

    expected = run(*_backward_nan_with_cache())
    model, opt = _backward_nan_with_cache()
    with nan_magic.watch(model, opt, on_detect="log", **options) as w:
        got = run(model, opt)
    assert _same(got.logits, expected.logits)
    for layer, want in zip(got.past_key_values.layers, expected.past_key_values.layers, strict=True):
        assert _same(layer.keys, want.keys) and _same(layer.values, want.values)
    assert (w.report.phase, w.report.step, w.report.module) == ("backward", 0, "transformer.h.0.attn")
    assert w.report.op == "aten.div.Tensor"
    assert w.report.source is not None and "value = torch.sqrt(value * value)" in w.report.source.line


@pytest.mark.parametrize("options", FIVE_MODES)
def test_generate_with_a_nan_is_named_and_generates_as_unwatched(options: dict) -> None:
    torch.manual_seed(0)
    (model,), run = _generate()
    expected = run()
    with nan_magic.watch(model, on_detect="log", **options) as w:
        got = run()
    assert torch.equal(got, expected)
    assert (w.report.phase, w.report.step, w.report.module, w.report.op) == (
        "forward", 1, "transformer.h.1.mlp.act", "aten.log.default")
