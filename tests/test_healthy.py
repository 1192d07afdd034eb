"""No false positive: healthy training runs raise nothing and record no event."""

from __future__ import annotations

import math

import pytest
import torch
from contract import benign as benign_cases
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import TensorRef, TensorRole


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padding = tokens == 0
        hidden = self.encoder(self.embed(tokens), src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).float()
        return self.head((hidden * keep).sum(1) / keep.sum(1))


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(16, 4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def _train(model: nn.Module, batches, steps: int) -> nan_magic.Watch:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with nan_magic.watch(model, opt) as w:
        for step in range(steps):
            x, y = batches(step)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w


def test_transformer_with_padding_masks_trains_clean() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()

    def batches(step: int):
        tokens = torch.randint(1, 50, (8, 12))
        lengths = torch.randint(3, 12, (8,))
        tokens[torch.arange(12) >= lengths[:, None]] = 0  # padded tails: masked keys
        return tokens, (tokens[:, 0] % 2)

    w = _train(model, batches, 200)
    assert w.report is None and w.events == []
    assert w.step == 200
    assert all(summary.loss is not None and summary.absmax is not None for summary in w.history)


def test_cnn_with_batchnorm_trains_clean() -> None:
    torch.manual_seed(0)
    model = TinyCNN()

    def batches(step: int):
        return torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))

    w = _train(model, batches, 200)
    assert w.report is None and w.events == []
    assert w.step == 200


# -- issue 15: deliberate infinities and GradScaler skips (the sweep is tests/contract/benign.py) --

MODES = {"default": {}, "defer": {"defer": True}, "ops": {"ops": True}}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pass_optimizer", [True, False], ids=["model+opt", "model"])
def test_skipped_steps_of_a_grad_scaler_not_passed_are_benign_events(mode: str, pass_optimizer: bool) -> None:
    expected = benign_cases._amp(2.0**24, 30, pass_optimizer).run()
    scenario = benign_cases._amp(2.0**24, 30, pass_optimizer)
    assert not any(isinstance(target, torch.amp.GradScaler) for target in scenario.targets)
    with nan_magic.watch(*scenario.targets, **MODES[mode]) as w:
        losses, parameters, scale = scenario.run()
    assert w.report is None
    skipped = len(w.events)
    assert skipped >= 1 and all(event.benign and event.phase == "backward" for event in w.events)
    assert all("the GradScaler skipped this step" in " ".join(event.notes) for event in w.events)
    assert scale == 2.0**24 / 2**skipped  # one benign event per halving of the scale: per skipped step
    expected_losses, expected_parameters, expected_scale = expected
    assert scale == expected_scale
    for got, want in zip([*losses, *parameters], [*expected_losses, *expected_parameters], strict=True):
        assert torch.equal(got, want)  # bit-identical to the unwatched run


def test_a_scaler_subclass_that_overrides_step_reports_each_skip_once() -> None:
    class LoggingScaler(torch.amp.GradScaler):
        calls = 0

        def step(self, optimizer, *args, **kwargs):  # type: ignore[no-untyped-def]
            LoggingScaler.calls += 1
            return super().step(optimizer, *args, **kwargs)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = LoggingScaler("cpu", init_scale=2.0**24)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    with nan_magic.watch(model) as w:
        for _ in range(10):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert LoggingScaler.calls == 10
    skipped = round(math.log2(2.0**24 / scaler.get_scale()))
    assert skipped >= 1 and len(w.events) == skipped and all(event.benign for event in w.events)


def test_every_grad_scaler_class_is_observed_only_while_watched() -> None:
    """torch.cuda.amp.GradScaler (deprecated, what older code uses) shares torch.amp's observed methods."""
    from torch.cuda.amp import GradScaler as CudaGradScaler

    originals = (torch.amp.GradScaler.scale, torch.amp.GradScaler.step)
    with nan_magic.watch(nn.Linear(2, 2)):
        observed = (torch.amp.GradScaler.scale, torch.amp.GradScaler.step)
        assert observed != originals
        assert (CudaGradScaler.scale, CudaGradScaler.step) == observed
        assert torch.amp.GradScaler.step.__wrapped__ is originals[1]  # type: ignore[attr-defined]
    assert (torch.amp.GradScaler.scale, torch.amp.GradScaler.step) == originals


@pytest.mark.parametrize("mode", MODES)
def test_a_causal_mask_argument_is_one_benign_data_event(mode: str) -> None:
    scenario = benign_cases._transformer_causal_kwarg()
    with nan_magic.watch(*scenario.targets, **MODES[mode]) as w:
        scenario.run()
    assert w.report is None
    (event,) = w.events
    assert event.benign
    mask = TensorRef.argument("kwargs['tgt_mask']")
    assert (event.phase, event.module, event.tensor, event.step) == ("data", "", mask, 0)
    assert (event.nan, event.posinf, event.neginf) == (0, 0, 10)  # 5 x 5 causal: 10 masked entries
    assert list(w.warnings) == []  # a mask is no batch: no extreme-input or constant-feature warning


@pytest.mark.parametrize("mode", MODES)
def test_a_mask_buffer_is_a_benign_event_and_what_it_passes_on_is_propagated(mode: str) -> None:
    scenario = benign_cases._mask_buffers()
    with nan_magic.watch(*scenario.targets, **MODES[mode]) as w:
        scenario.run()
    assert w.report is None
    (event,) = w.events
    causal = TensorRef(TensorRole.BUFFER, "scores.causal")
    assert event.benign and (event.phase, event.module, event.tensor) == ("forward", "scores", causal)


class _Biased(nn.Module):
    """Attention scores plus an additive bias: a mask only if its name says so, once it has non-zero values."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, alibi_mask: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        scores = self.proj(x) @ x.transpose(-1, -2)
        return (scores + (alibi_mask if alibi_mask is not None else bias)).softmax(-1)


def _alibi(size: int) -> torch.Tensor:
    distance = torch.arange(size)[None, :] - torch.arange(size)[:, None]
    return (-0.5 * distance.abs().float()).masked_fill(distance > 0, float("-inf"))


class _AttentionBiased(nn.Module):
    """The same scores, given their bias under an attention bias's own names (xformers/MPT, ALiBi, T5)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:
        bias = next(value for value in (attn_bias, alibi, position_bias) if value is not None)
        return ((self.proj(x) @ x.transpose(-1, -2)) + bias).softmax(-1)


def test_a_named_mask_may_fold_in_a_bias_an_unnamed_one_may_not() -> None:
    torch.manual_seed(0)
    model, x = _Biased(), torch.randn(3, 4)
    with nan_magic.watch(model) as w:
        model(x, alibi_mask=_alibi(3))
    assert w.report is None and [event.benign for event in w.events] == [True]
    # A name that says attention bias counts as a mask's: an ALiBi with its causal -inf is deliberate there.
    biased = _AttentionBiased()
    for name in ("attn_bias", "alibi", "position_bias"):
        with nan_magic.watch(biased) as w:
            biased(x, **{name: _alibi(3)})
        assert w.report is None and [event.benign for event in w.events] == [True], name
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        model(x, bias=_alibi(3))
    report = caught.value.report
    assert (report.phase, report.tensor, report.benign) == ("data", TensorRef.argument("kwargs['bias']"), False)


def test_a_collapsing_scale_raises_with_the_scaler_unpassed_and_its_scene_holds_the_scaler(tmp_path) -> None:
    scenario = benign_cases._amp(2.0**16, 40, pass_optimizer=True, guarded=True)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, dump=str(tmp_path)) as w:
        scenario.run()
    report = caught.value.report
    assert report.cause is not None and report.cause.label == "grad-scaler-collapse"
    assert sum(event.benign for event in w.events) == 15  # COLLAPSE_SKIPS benign skips first
    assert report.scene is not None
    scalers = nan_magic.load_scene(report.scene).data["scalers"]
    assert [entry["type"] for entry in scalers] == ["GradScaler"]
