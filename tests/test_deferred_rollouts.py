"""A step of more top-level calls than the step replay holds, in the deferred mode (defer=True, CUDA's default).

A policy rollout calls the model many times under ``no_grad`` before its first optimizer step, and its masked
logits hold a deliberate -inf at each call. The deferred check judged them at the optimizer step, after the
oldest calls were let go (MAX_CALLS): no replay could say the -inf was deliberate, and the watch raised a false
alarm ("the tensor was freed"). What the step holds is now judged as a held call is about to be let go.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.localize.replay.tiered.step_keeping import MAX_CALLS
from nan_magic.note_records import Note


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 5)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor, shift: torch.Tensor, masked: bool) -> torch.Tensor:
        logits = self.head(obs) + torch.log(shift)  # a negative shift: NaN
        return logits.masked_fill(~legal, float("-inf")) if masked else logits


def _rollouts(calls: int, masked: bool, bad_call: int | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    policy = Policy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.01)
    actions = []
    with nan_magic.watch(policy, opt, defer=True):
        for update in range(2):
            with torch.no_grad():
                for t in range(calls):
                    shift = torch.tensor(-1.0 if (update, t) == (0, bad_call) else 1.0)
                    legal = torch.rand(5) < 0.5
                    legal[0] = True
                    actions.append(policy(torch.randn(6), legal, shift, masked).argmax())
            legal = torch.ones(4, 5, dtype=torch.bool)
            loss = policy(torch.randn(4, 6), legal, torch.tensor(1.0), masked).logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return actions


@pytest.mark.parametrize("calls", [MAX_CALLS - 2, MAX_CALLS + 4, 5 * MAX_CALLS])
def test_a_masked_rollout_longer_than_the_calls_held_is_calm(calls: int) -> None:
    assert len(_rollouts(calls, masked=True)) == 2 * calls  # (failed before at MAX_CALLS + 4: a false alarm)


@pytest.mark.parametrize("bad_call", [1, MAX_CALLS + 2])
def test_a_nan_in_a_long_rollout_is_named_at_its_step_and_module(bad_call: int) -> None:
    with pytest.raises(nan_magic.NonFiniteError) as raised:
        _rollouts(3 * MAX_CALLS, masked=False, bad_call=bad_call)
    report = raised.value.report
    assert (report.phase.value, report.module, report.module_type, report.step) == ("forward", "", "Policy", 0)
    assert (report.nan, report.op, report.reproduced) == (1, "aten.log.default", True)  # the log's own output: one NaN


class ShiftedPolicy(nn.Module):
    """The NaN's cause is an attribute the loop sets before each call, not an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 5)
        self.shift = 1.0

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return (self.head(obs) + torch.log(obs.sum() * 0 + self.shift)).masked_fill(~legal, float("-inf"))


def test_a_nan_in_a_masked_call_is_raised_when_its_replay_reproduces_it() -> None:
    with pytest.raises(nan_magic.NonFiniteError) as raised:
        _rollouts(6, masked=True, bad_call=1)
    assert (raised.value.report.step, raised.value.report.op) == (0, "aten.log.default")


def test_a_nan_whose_cause_the_loop_changed_before_the_deferred_check_is_raised() -> None:
    # The call is replayed at the step's check, with the attribute the loop changed since (the NaN's cause): the
    # replay found only the deliberate -inf, and the NaN was taken as benign, never raised (a silent miss in the
    # GPU default). It is raised now as what the check saw, not reproduced, saying why (replay/seen_again.py).
    torch.manual_seed(0)
    policy = ShiftedPolicy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.01)
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(policy, opt, defer=True):
        with torch.no_grad():
            for t in range(4):
                policy.shift = -1.0 if t == 1 else 1.0
                policy(torch.randn(6), torch.rand(5) < 0.5).argmax()
        loss = policy(torch.randn(4, 6), torch.ones(4, 5, dtype=torch.bool)).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = raised.value.report
    assert (report.phase.value, report.module, report.step, report.reproduced) == ("forward", "", 0, False)
    not_reproduced = next(note for note in report.note_facts if note.kind == "not-reproduced")
    assert Note.from_pair(not_reproduced.fact("reason")).fact("kinds") == ("nan",)
    assert "without the nan the check saw" in report.to_text()
