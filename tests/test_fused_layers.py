"""PyTorch's fused inference layers (torch.backends.mha's fast path) taken apart by the replay (replay/fused.py).

In eval under no_grad a TransformerEncoderLayer or MultiheadAttention runs as one fused op; the replay that named
it runs again with the fast path off and names the op inside the layer, its submodule and the user's line.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic

#: The modes that replay a call (the tiered step replay, the per-module replay); ops=True traces live (below).
REPLAYING = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"}}
ENCODER_LINE = "model(x)  # the evaluation call"


def _evaluate_encoder(scale: float, **options: object) -> nan_magic.Watch:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    with nan_magic.watch(model, **options) as watch, torch.no_grad():
        for step in range(3):
            x = torch.randn(2, 5, 16) * (scale if step == 1 else 1.0)
            model(x)  # the evaluation call
    return watch


class _Attending(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.attn(x, x, x, need_weights=False)
        return self.head(h)


@pytest.mark.parametrize("mode", REPLAYING)
def test_a_fused_encoder_layer_is_named_at_the_op_inside_it(mode: str) -> None:
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _evaluate_encoder(1e20, **REPLAYING[mode])  # q k^T of inputs near 1e20 overflows: softmax of inf is NaN
    report = caught.value.report
    assert (report.phase, report.step, report.module) == ("forward", 1, "layers.0.self_attn")
    assert report.op is not None and report.op.startswith("aten._scaled_dot_product")
    assert report.source is not None and report.source.line.strip() == ENCODER_LINE
    assert any(note.startswith("aten._transformer_encoder_layer_fwd.default, PyTorch's fused kernel")
               for note in report.notes)
    assert report.cause is not None and report.cause.label == "bad-input-data"
    assert torch.backends.mha.get_fastpath_enabled()  # put back


@pytest.mark.parametrize("mode", REPLAYING)
def test_a_fused_multi_head_attention_is_named_at_the_op_inside_it(mode: str) -> None:
    torch.manual_seed(0)
    model = _Attending().eval()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, **REPLAYING[mode]), \
            torch.no_grad():
        for step in range(3):
            model(torch.randn(2, 5, 16) * (1e20 if step == 1 else 1.0))
    report = caught.value.report
    assert (report.module, report.step) == ("attn", 1)
    assert report.op is not None and report.op.startswith("aten._scaled_dot_product")
    assert any(note.startswith("aten._native_multi_head_attention.default") for note in report.notes)


def test_ops_mode_names_the_fused_op_it_saw_run() -> None:
    # The live op tracer saw the fused op make the value; it runs no replay to take it apart: the layer and the
    # fused op, at the user's line.
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _evaluate_encoder(1e20, ops=True)
    report = caught.value.report
    assert (report.module, report.op) == ("layers.0", "aten._transformer_encoder_layer_fwd.default")
    assert report.source is not None and report.source.line.strip() == ENCODER_LINE


def test_a_fast_path_the_user_turned_off_stays_off_and_the_healthy_twin_is_calm() -> None:
    assert _evaluate_encoder(1.0).events == [] and torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with pytest.raises(nan_magic.NonFiniteError) as caught:
            _evaluate_encoder(1e20)
        report = caught.value.report
        assert report.module == "layers.0.self_attn" and not any("fused kernel" in note for note in report.notes)
        assert not torch.backends.mha.get_fastpath_enabled()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
