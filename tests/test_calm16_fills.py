"""Deliberate fills with -inf or NaN, and NaN used as "missing", stay calm in the five modes (issue 25; harness:
test_calm16.py): ``F.pad(value=-inf)`` before a max pool, ``pad_packed_sequence(padding_value=-inf)`` before a max
over time, ``bucketize`` over boundaries with -inf/inf ends, NaN-aware reductions (``where(mask, x, nan)`` then
``nanmean``), a ``new_full(-inf)`` running maximum by ``scatter_reduce``, multi-task labels with NaN for "not
measured" masked in the loss code (Tox21 style), and a NaN-filled label tensor selected with ``isnan``.
"""

from __future__ import annotations

import pytest
import torch
from test_calm16 import Loop, assert_calm, sgd_loop
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from watching import FIVE_MODES, raised

NEG_INF, NAN = float("-inf"), float("nan")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class PadMaxPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv1d(4, 8, 3), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(self.conv(x), (2, 2), value=NEG_INF)  # a max pool that never picks the padding
        return self.head(F.max_pool1d(h, 5, stride=1).amax(-1))


class PackedMax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        out, _ = pad_packed_sequence(packed, batch_first=True, padding_value=NEG_INF)
        return self.head(out.max(1).values)


class Binned(nn.Module):
    """Embeds a continuous feature by its bin; the outer boundaries are -inf and inf."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("edges", torch.tensor([NEG_INF, -1.0, 0.0, 1.0, float("inf")]))
        self.emb, self.head = nn.Embedding(6, 4), nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bins = torch.bucketize(x[:, 0], self.edges)
        return self.head(torch.cat([self.emb(bins), x[:, 1:2]], -1))


class NanPool(nn.Module):
    """Mean over the kept positions by NaN-aware reductions: the dropped ones are set to NaN on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        mean = torch.where(keep[..., None], h, NAN).nanmean(1)
        total = h.masked_fill(~keep[..., None], NAN).nansum(1)
        return self.head(torch.cat([mean, total], -1))


class SegmentMax(nn.Module):
    """The max of each segment by ``scatter_reduce(amax)`` into a ``new_full(-inf)`` (a segment may be empty: its
    -inf is replaced)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        out = h.new_full((4, 4), NEG_INF).scatter_reduce(0, segment[:, None].expand_as(h), h, "amax")
        return self.head(torch.where(torch.isinf(out), torch.zeros_like(out), out))


def missing_labels() -> Loop:
    """Multi-task regression, labels NaN where not measured: the loss is taken over the measured ones only."""
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    xs = [torch.randn(8, 6) for _ in range(3)]
    ys = [torch.randn(8, 3) for _ in range(3)]
    for y in ys:
        y[torch.rand(8, 3) < 0.3] = NAN

    def loss_of(m: nn.Module, step: int) -> torch.Tensor:
        pred, y = m(xs[step]), ys[step]
        measured = ~torch.isnan(y)
        return F.mse_loss(pred[measured], y[measured])
    return sgd_loop(model, loss_of)


def missing_labels_by_where() -> Loop:
    """The same, written as a masked mean: ``where(measured, (pred - y) ** 2, 0)`` (the unselected branch NaN)."""
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(8, 6)
    y = torch.randn(8, 3)
    y[torch.rand(8, 3) < 0.3] = NAN
    y_filled = torch.nan_to_num(y)

    def loss_of(m: nn.Module, step: int) -> torch.Tensor:
        measured = ~torch.isnan(y)
        err = torch.where(measured, (m(x) - y_filled) ** 2, torch.zeros(()))
        return err.sum() / measured.sum()
    return sgd_loop(model, loss_of)


def _keep() -> torch.Tensor:
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1, 3:] = False
    keep[2, 1:] = False
    return keep


FILLS = {
    "pad-inf-max-pool": lambda: sgd_loop(PadMaxPool(), lambda m, s: m(torch.randn(2, 4, 7)).pow(2).mean()),
    "pad-packed-sequence-inf": lambda: sgd_loop(PackedMax(), lambda m, s: m(torch.randn(3, 5, 4),
                                                                            torch.tensor([5, 3, 1])).pow(2).mean()),
    "bucketize-inf-boundaries": lambda: sgd_loop(Binned(), lambda m, s: m(torch.randn(8, 2) * 2).pow(2).mean()),
    "nan-fill-nanmean-nansum": lambda: sgd_loop(NanPool(), lambda m, s: m(torch.randn(3, 5, 4), _keep()).pow(2)
                                                .mean()),
    "scatter-reduce-amax-from-inf": lambda: sgd_loop(SegmentMax(), lambda m, s: m(
        torch.randn(6, 4), torch.tensor([0, 0, 1, 1, 1, 3])).pow(2).mean()),
    "missing-labels-selected": missing_labels,
    "missing-labels-by-where": missing_labels_by_where,
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", FILLS)
def test_deliberate_fills_and_missing_values_are_calm(name: str, options: dict) -> None:
    assert_calm(FILLS[name], options)


def test_the_fills_leave_every_parameter_and_gradient_finite() -> None:
    for build in FILLS.values():
        torch.manual_seed(0)
        loop = build()
        loop.run()
        assert all(torch.isfinite(p).all() and torch.isfinite(p.grad).all() for p in loop.targets[0].parameters()
                   if p.grad is not None)


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_nan_label_the_loss_does_not_mask_is_named_as_the_data(options: dict) -> None:
    # Broken twin of the missing labels: one NaN label, the loss taken over every label.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    xs = [torch.randn(8, 6) for _ in range(3)]
    ys = [torch.randn(8, 3) for _ in range(3)]
    ys[1][2, 1] = NAN
    loop = sgd_loop(model, lambda m, step: F.mse_loss(m(xs[step]), ys[step]))
    report = raised(loop.run, *loop.targets, **options)
    assert (report.phase, report.module, report.step, str(report.tensor)) == ("data", None, 1, "ys[1]")
    assert (report.nan, report.numel) == (1, 24)
