"""The generators' state a step replay runs the model from: taken at each call where the model may draw.

A top-level call keeps the default generators' state so that its replay draws the same numbers (a dropout
mask, noise); a model that provably draws none (an ``nn.Sequential`` of torch leaf modules: hot/kept/rng.py's
ModelStates) is given the state it took first, while its children stay the same. What a user sees: the
producer named with its op and counts, ``reproduced`` true, in both timings; where the counts depend on the
draw, only a replay from the same state reproduces them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.hot.kept import rng
from nan_magic.localize.replay.tiered import step_keeping

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]
BIG = 1e38  # finite; twice it is too, four times it is not


def _doubling(width: int) -> nn.Linear:
    layer = nn.Linear(width, width, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(width) * 2)
    return layer


class _FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = _doubling(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(F.dropout(x, 0.5, self.training))  # kept: 2x, then 4x: inf


class _RandInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = _doubling(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (torch.rand(x.shape) * 4)  # 2x, then up to 4x: inf where the draw is over 1.7


def _noisy(h: torch.Tensor) -> torch.Tensor:
    return h * (1 + torch.randn_like(h).abs())  # 2e38 times over 1.7: inf


class _NoiseInHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = _doubling(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _noisy(self.lin(x))


class _Counting:
    """The CPU generator, counting the states taken of it."""

    def __init__(self, calls: list[int]) -> None:
        self.calls = calls

    def get_state(self) -> torch.Tensor:
        self.calls.append(1)
        return torch.default_generator.get_state()


def _train(model: nn.Module, batches: list[torch.Tensor], opt: torch.optim.Optimizer) -> None:
    for x in batches:
        loss = model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _run(model: nn.Module, options: dict[str, object], swap: nn.Module | None = None) -> nan_magic.Report:
    """Five steps, the fourth's batch 1e38; ``swap`` replaces ``model[0]`` after the second, mid-watch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights stay as built
    torch.manual_seed(1)
    batches = [torch.rand(16, 8) for _ in range(5)]
    batches[3] = torch.full((16, 8), BIG)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, batches[:2], opt)
        if swap is not None:
            model[0] = swap
        _train(model, batches[2:], opt)
    return caught.value.report


@pytest.mark.parametrize(("model", "taken"), [(lambda: nn.Sequential(nn.ReLU(), _doubling(8)), 1),
                                              (lambda: nn.Sequential(nn.Dropout(0.5), _doubling(8)), 5),
                                              (lambda: nn.Sequential(nn.Sequential(_doubling(8))), 5),
                                              (_FunctionalDropout, 5)])
def test_the_state_is_taken_once_only_for_a_sequential_of_leaf_modules_that_draw_none(model, taken, monkeypatch
                                                                                      ) -> None:
    calls: list[int] = []
    capture = rng.capture_rng_state
    monkeypatch.setattr(rng, "capture_rng_state", lambda: calls.append(1) or capture())
    # (A model with a forward of its own takes the CPU generator's state inline, in StepKeeping.begin.)
    monkeypatch.setattr(step_keeping, "_CPU_GENERATOR", _Counting(calls))
    built = model()
    opt = torch.optim.SGD(built.parameters(), lr=0.0)
    with nan_magic.watch(built, opt) as w:
        _train(built, [torch.rand(16, 8) for _ in range(5)], opt)
    assert w.report is None and len(calls) == taken


@pytest.mark.parametrize("options", TIMINGS)
def test_a_sequential_of_torch_leaf_modules_keeps_no_state_and_its_replay_reproduces(options: dict) -> None:
    report = _run(nn.Sequential(nn.ReLU(), _doubling(8), _doubling(8)), options)
    assert (report.phase, report.module, report.op, report.step) == ("forward", "2", "aten.mm.default", 3)
    assert report.reproduced is True and report.posinf == 128


@pytest.mark.parametrize("options", TIMINGS)
def test_a_dropout_swapped_into_the_sequential_mid_watch_is_replayed_with_its_mask(options: dict) -> None:
    torch.manual_seed(0)
    report = _run(nn.Sequential(nn.Identity(), _doubling(8), _doubling(8)), options, swap=nn.Dropout(0.5))
    assert (report.phase, report.module, report.op, report.step) == ("forward", "1", "aten.mm.default", 3)
    assert report.reproduced is True and 0 < report.posinf < 128


def _noise_before(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (_noisy(args[0]),)  # a user's pre-hook that draws: 2e38 times over 1.7 is inf after the next doubling


@pytest.mark.parametrize("on_child", [False, True], ids=["on the sequential", "on a child"])
@pytest.mark.parametrize("options", TIMINGS)
def test_a_users_hook_that_draws_makes_the_sequential_keep_a_state_each_call(options: dict, on_child: bool) -> None:
    model = nn.Sequential(_doubling(8), _doubling(8))
    (model[1] if on_child else model).register_forward_pre_hook(_noise_before)
    torch.manual_seed(0)
    report = _run(model, options)
    assert (report.phase, report.step) == ("forward", 3)
    assert report.reproduced is True and 0 < report.posinf < 128


@pytest.mark.parametrize("options", TIMINGS)
def test_a_dropout_in_a_sequential_is_replayed_with_the_same_mask(options: dict) -> None:
    model = nn.Sequential(nn.Dropout(0.5), nn.Sequential(_doubling(8)))
    torch.manual_seed(0)
    report = _run(model, options)
    assert (report.phase, report.module, report.op, report.step) == ("forward", "1.0", "aten.mm.default", 3)
    assert report.reproduced is True and 0 < report.posinf < 128


@pytest.mark.parametrize("model", [_FunctionalDropout, _RandInForward, _NoiseInHelper])
@pytest.mark.parametrize("options", TIMINGS)
def test_a_draw_in_the_models_own_code_is_replayed_with_the_same_numbers(model: type, options: dict) -> None:
    report = _run(model(), options)
    assert (report.phase, report.step) == ("forward", 3)
    assert report.reproduced is True and 0 < report.posinf < 128


@pytest.mark.parametrize("options", TIMINGS)
def test_a_dropout_inserted_into_the_sequential_mid_watch_is_replayed_with_its_mask(options: dict) -> None:
    # (An insert, not a swap: the children grow by one; the Sequential drew nothing until then, its state was kept.)
    model = nn.Sequential(_doubling(8), _doubling(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    torch.manual_seed(1)
    batches = [torch.rand(16, 8) for _ in range(4)] + [torch.full((16, 8), BIG / 2)]
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, batches[:2], opt)
        model.insert(0, nn.Dropout(0.5))  # 0.5e38 kept as 1e38, doubled twice: inf where kept
        _train(model, batches[2:], opt)
    report = caught.value.report
    assert (report.phase, report.module, report.op, report.step) == ("forward", "2", "aten.mm.default", 4)
    assert report.reproduced is True and 0 < report.posinf < 128


@pytest.mark.parametrize(
    "model",
    [
        lambda: nn.Sequential(nn.Dropout(0.5), _doubling(8), _doubling(8)),
        lambda: nn.Sequential(_doubling(8), _doubling(8)),
        _RandInForward,
    ],
    ids=["dropout", "draws none", "own forward"],
)
@pytest.mark.parametrize("options", TIMINGS)
def test_a_loop_that_seeds_each_step_is_replayed_from_the_steps_own_state(options: dict, model) -> None:
    # torch.manual_seed before each step: the state a call ran from is the seed's, not the last call's (a Sequential
    # that draws none is given its first state again: it draws nothing from it).
    built = model()
    opt = torch.optim.SGD(built.parameters(), lr=0.0)
    torch.manual_seed(1)
    batches = [torch.rand(16, 8) for _ in range(5)]
    batches[3] = torch.full((16, 8), BIG)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(built, opt, **options):
        for step, x in enumerate(batches):
            torch.manual_seed(100 + step)
            loss = built(x).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step) == ("forward", 3)
    assert report.reproduced is True and 0 < report.posinf <= 128
    if isinstance(built, nn.Sequential):  # the failing step's own draw, unwatched: the counts the replay must give
        torch.manual_seed(103)
        assert report.module == "1" and report.posinf == int(torch.isposinf(built[:2](batches[3])).sum())
