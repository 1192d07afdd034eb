"""``replay=False`` (and ``fixes=False``) saves work on a healthy step: it never adds any.

A user turns replay off to make the watch cheaper. The twentieth round's launch-bound timing put it dearer than
the default on two models (benchmarks/README.md); the calls, counted, say otherwise (hot21): the healthy step
with replay off runs the default's step less the step replay's material (StepReplays.begin/finish/
release_stepped, the generators' state, the caller's line; the same aten ops). Counted, not timed, so it holds on
a busy machine: every function of ours is called no more often with replay off than in the default, over steady
steps that include a per-module step (``full_every``), in the default, deferred and full modes. One check is kept
on purpose: in a per-module step, a pass-through module on a value its parent's own code computed is checked
where no replay of the parent would name it (the last test).
"""

from __future__ import annotations

import collections
import cProfile
import pstats

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic

SETTLE, STEPS, FULL_EVERY = 12, 16, 8  # (the window holds two per-module steps)
MODES = [
    pytest.param({}, id="default"),
    pytest.param({"defer": True}, id="deferred"),
    pytest.param({"mode": "full"}, id="full"),
]
OFF = [pytest.param({"replay": False}, id="replay-off"), pytest.param({"replay": False, "fixes": False}, id="both-off")]


class _Net(nn.Module):
    """A forward of the user's (the step replay keeps the generators' state for it), a dropout, a BatchNorm.

    The dropout's input is a module's output (a ReLU's), known finite: it is passed through in every mode. (One on
    a value the parent's own code computed is checked where no replay of the parent runs: test below.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.act(self.norm(self.inp(x)))))


def _calls_of_ours(options: dict) -> collections.Counter[str]:
    """Calls of nan_magic's functions over :data:`STEPS` healthy steps after :data:`SETTLE`, by function."""
    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    with nan_magic.watch(model, optimizer, full_every=FULL_EVERY, **options) as watch:
        for _ in range(SETTLE):
            step()
        profile = cProfile.Profile()
        profile.enable()
        try:
            for _ in range(STEPS):
                step()
        finally:
            profile.disable()
    assert not watch.events
    counts: collections.Counter[str] = collections.Counter()
    for (filename, _line, function), (primitive, *_rest) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        if "nan_magic" in filename:
            counts[f"{filename.split('nan_magic')[-1]}:{function}"] += primitive
    return counts


@pytest.mark.parametrize("off", OFF)
@pytest.mark.parametrize("mode", MODES)
def test_with_replay_off_no_function_of_ours_runs_more_often_on_a_healthy_step(mode: dict, off: dict) -> None:
    default, without = _calls_of_ours(mode), _calls_of_ours({**mode, **off})
    more = {name: (default[name], count) for name, count in without.items() if count > default[name]}
    assert not more, f"called more often with {off} (default, off): {more}"
    # (and less in all: the step replay's material is not taken; the immediate tiered step by about a tenth)
    assert sum(without.values()) < sum(default.values())


class _Scaled(nn.Module):
    """A dropout on a value this module's own code computed (as test_transparent.py's)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x * self.scale)  # 2e38 is finite; the dropout's 1 / (1 - 0.5) overflows it


def test_the_one_check_replay_off_keeps_in_full_mode_names_the_dropout_no_replay_would() -> None:
    # mode="full" leaves a dropout on its parent's own value to the parent's replay, which names its op inside the
    # parent (test_transparent.py). With replay off nothing would: the dropout's call is checked, the one check
    # replay=False adds to a per-module step, and what names it.
    def model(scale: float) -> nn.Sequential:
        torch.manual_seed(0)
        built = nn.Sequential(nn.Linear(4, 4), _Scaled(scale))
        with torch.no_grad():
            built[0].weight.zero_()
            built[0].bias.fill_(2.0)
        return built

    healthy = model(1.0)
    for replay, checked in ((True, False), (False, True)):
        with nan_magic.watch(healthy, mode="full", replay=replay) as watch:
            healthy(torch.ones(64, 4)).sum().backward()
            names = {call.name for call in watch.log.calls if call.phase == "forward" and call.info is not None}
        assert ("1.drop" in names) is checked
    failing = model(1e38)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(failing, mode="full", replay=False):
        failing(torch.ones(64, 4))
    report = caught.value.report
    assert (report.phase, report.module, report.module_type, report.op) == ("forward", "1.drop", "Dropout", None)
