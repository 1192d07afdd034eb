"""The fast reductions: the probe (fused and split), ``norms`` (CPU dot and sum paths, fused groups), reads."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.hot.reads import (
    _SPLIT_PROBE_MAX_BYTES,
    _SPLIT_PROBE_NUMEL,
    DOT_MIN_NUMEL,
    norms,
    probe,
    read_batched,
    read_scalars,
)
from nan_magic.records import TensorRef, TensorRole

BIG = (DOT_MIN_NUMEL // 64, 64)  # large enough for the per-tensor CPU path


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(BIG),  # dot path
        torch.randn(BIG, dtype=torch.float64),  # dot path, double
        torch.randn(BIG[1], BIG[0]).t(),  # large but not contiguous: the fused group
        torch.randn(7),  # small: the fused group
        torch.randn(BIG).half(),  # half precision: the fused group
    ]


def test_norms_equal_the_two_norm_on_every_path() -> None:
    tensors = _tensors()
    got = read_scalars(norms(tensors))
    expected = [float(torch.linalg.vector_norm(tensor.double())) for tensor in tensors]
    for value, truth in zip(got, expected):
        assert value == pytest.approx(truth, rel=2e-3)


@pytest.mark.parametrize("finiteness_only", [False, True])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_single_bad_element_shows_on_every_path(bad: float, finiteness_only: bool) -> None:
    tensors = _tensors()
    for index in range(len(tensors)):
        spoiled = [tensor.clone() for tensor in tensors]
        spoiled[index][(5,) * spoiled[index].dim()] = bad
        values = read_scalars(norms(spoiled, finiteness_only=finiteness_only))
        assert [math.isfinite(value) for value in values] == [i != index for i in range(len(tensors))]


def test_finiteness_only_gives_the_sum_of_a_large_cpu_tensor() -> None:
    tensor = torch.full(BIG, 0.5)
    (value,) = read_scalars(norms([tensor], finiteness_only=True))
    assert value == pytest.approx(0.5 * tensor.numel())


def test_norms_keep_the_order_and_do_not_touch_autograd() -> None:
    weight = torch.randn(BIG, requires_grad=True)
    small = torch.ones(3, requires_grad=True)
    result = norms([small, weight, small])
    assert all(not value.requires_grad for value in result)
    assert read_scalars(result)[0] == pytest.approx(math.sqrt(3))
    assert read_scalars(result)[2] == pytest.approx(math.sqrt(3))


@pytest.mark.parametrize("read", [read_scalars, read_batched])  # item by item (CPU) and stacked (GPU)
def test_scalars_are_read_in_order_whatever_their_dtype(read) -> None:
    scalars = [torch.tensor(1.5), torch.tensor(math.nan, dtype=torch.float64), torch.tensor(-math.inf).half(),
               torch.tensor(2.0, dtype=torch.bfloat16), torch.tensor(3)]
    values = read(scalars)
    assert [type(value) for value in values] == [float] * 5
    assert values[0] == 1.5 and math.isnan(values[1]) and values[2:] == [-math.inf, 2.0, 3.0]


# The fused CPU probe, the split one, and the fused one again for a tensor beyond the cache.
@pytest.mark.parametrize("numel", [1000, _SPLIT_PROBE_NUMEL, _SPLIT_PROBE_MAX_BYTES // 4])
def test_the_probe_gives_min_max_and_shows_every_kind(numel: int) -> None:
    torch.manual_seed(0)
    tensor = torch.randn(numel)
    low, high = probe(tensor)
    assert (float(low), float(high)) == (float(tensor.min()), float(tensor.max()))
    for bad, expected in [(math.nan, (math.nan, math.nan)), (math.inf, (float(low), math.inf))]:
        spoiled = tensor.clone()
        spoiled[numel // 2] = bad
        got = tuple(float(value) for value in probe(spoiled))
        assert got == pytest.approx(expected, nan_ok=True)
    spoiled = tensor.clone()
    spoiled[-1] = -math.inf
    assert float(probe(spoiled)[0]) == -math.inf


def test_a_float32_gradient_is_checked_by_its_sum_and_an_overflowing_sum_is_no_alarm() -> None:
    torch.manual_seed(0)
    model = nn.Linear(1, 4)
    x = torch.full((2, 1), 1e-3)
    with nan_magic.watch(model, mode="full") as w:
        out = model(x)
        # (a gradient of ones from the graph: one given to backward() is read as data, by its range: hunt20)
        out.sum().backward()
        (ordinary,) = [call.outputs[0] for call in w.log.calls if call.phase == "backward"]
        assert not ordinary.ranged  # finiteness only: a sum
        stats = ordinary.stats()
        assert (stats.nan, stats.posinf, stats.neginf, stats.min, stats.max) == (0, 0, 0, None, None)
    with nan_magic.watch(model, mode="full") as w:
        out = model(x[:1])  # one row: the parameters' own gradients (a sum over the batch) stay finite
        # Finite gradients whose sum overflows float32: the exact probe clears them.
        out.backward(torch.full_like(out, 3e38))
        (huge,) = [call.outputs[0] for call in w.log.calls if call.phase == "backward"]
        assert huge.ranged and huge.kinds == frozenset() and huge.high == pytest.approx(3e38)
    assert w.report is None


class TwoBranches(nn.Module):
    """A residual-style sum: autograd hands one gradient tensor to both branches."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) + self.right(x)


def test_one_gradient_tensor_seen_twice_keeps_its_finiteness_only_probe() -> None:
    torch.manual_seed(0)
    model = TwoBranches()
    with nan_magic.watch(model, mode="full") as w:
        model(torch.randn(3, 4)).sum().backward()
        grads = [call.outputs[0] for call in w.log.calls if call.phase == "backward"]
        assert len(grads) >= 2 and all(not record.ranged and not record.kinds for record in grads)
    assert w.report is None


def test_one_gradient_tensor_handed_to_two_branches_is_summed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = TwoBranches()
    summed: list[tuple[int, ...]] = []
    original = torch.Tensor.sum

    def counting_sum(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        summed.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    with nan_magic.watch(model, mode="full") as w:
        out = model(torch.randn(3, 4))
        loss = out.sum()
        monkeypatch.setattr(torch.Tensor, "sum", counting_sum)
        loss.backward()
        monkeypatch.undo()
        rows = [call.outputs[0].path for call in w.log.calls if call.phase == "backward"]
    # The addition hands the model output's gradient to both branches: three checks, one sum.
    assert rows == [TensorRef(TensorRole.OUTPUT_GRADIENT, owner, "output") for owner in ("", "right", "left")]
    assert summed.count((3, 4)) == 1
    assert w.report is None


def test_a_record_made_for_a_finite_gradient_has_every_field_of_a_probed_one() -> None:
    from nan_magic.hot.kept.call_records import Call, TensorRecord
    from nan_magic.records import Phase

    call = Call(0, Phase.BACKWARD, None, None, None)
    record = TensorRecord.finite("grad of input[0]", torch.float32, (2, 3), call)
    assert all(hasattr(record, name) for name in TensorRecord.__slots__)
    assert record.live() is None and not record.ranged and not record.kinds and record.status == "ok"
    stats = record.stats()
    assert (stats.shape, stats.numel, stats.nan, stats.min) == ((2, 3), 6, 0, None)
