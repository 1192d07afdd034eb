"""defer=True over a batch the loop writes in place after the model read it (defer-s40): the deferred check's replay
starts from the value the call read, and a loop that writes no model input keeps no copy of one."""

from __future__ import annotations

import pytest
import torch
from contract.defer_s40 import _written_after_the_call
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError


@pytest.mark.parametrize("how", ["add", "prefetch"])
def test_deferred_report_of_a_batch_written_after_the_call_names_the_op_and_a_verified_fix(how: str) -> None:
    scenario = _written_after_the_call(1, how)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, defer=True):
        scenario.run()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "", 1, "aten.log.default")
    assert report.cause is not None and report.cause.label == "log-domain"
    text = report.to_text()
    assert "modified in place since the call" not in text, text
    assert "-> verified" in text, text  # the fix trial starts from the batch the call read, too


def test_a_loss_code_write_of_no_model_input_keeps_no_copy() -> None:
    """A metric accumulated in place in the loss code (``total.add_(loss.detach())``) is no model input: the kept
    call holds no copy of anything, and the watched run computes exactly the unwatched one."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        return model, torch.optim.SGD(model.parameters(), lr=0.01), [torch.randn(6, 4) for _ in range(3)], (
            torch.zeros(()))

    def run(model: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor], total: torch.Tensor,
            kept: list[int] | None = None, watch: nan_magic.Watch | None = None) -> torch.Tensor:
        for x in xs:
            loss = model(x).pow(2).mean()
            total.add_(loss.detach())
            if watch is not None and kept is not None:
                kept.append(sum(len(root.inputs_before) for root in watch.replays.calls))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return total

    expected = run(*build())
    model, opt, xs, total = build()
    kept: list[int] = []
    with nan_magic.watch(model, opt, defer=True) as w:
        got = run(model, opt, xs, total, kept, w)
    assert w.report is None
    assert kept == [0, 0, 0]
    assert torch.equal(got, expected)


def test_a_batch_written_after_the_call_is_copied_once_a_step_before_its_first_write() -> None:
    """The second view ``x.mul_(1.5).add_(0.25)`` writes the batch twice: one copy, of the value the call read."""
    scenario = _written_after_the_call(None, "mul")
    model, opt = scenario.targets
    seen: list[tuple[int, bool]] = []
    original = F.mse_loss

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        roots = list(w.replays.calls)
        copies = [copy for root in roots[:1] for _tensor, copy in root.inputs_before]
        seen.append((len(copies), bool(copies) and bool((copies[0] >= 0.5).all() and (copies[0] < 1.5).all())))
        return original(a, b)

    F.mse_loss = spy  # type: ignore[assignment]
    try:
        with nan_magic.watch(model, opt, defer=True) as w:
            scenario.run()
    finally:
        F.mse_loss = original  # type: ignore[assignment]
    assert w.report is None
    assert seen == [(1, True)] * 4  # one copy a step, of the batch as drawn (rand + 0.5), not as written


class _WideLog(nn.Module):
    """The log of a wide batch (4 x 600,000 float32: 9.6 MB), mean-pooled into a head, with a skip of its mean."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.log(x)
        return self.head(h.view(len(h), -1, 16).mean(1)) + 0.1 * h.mean(1, keepdim=True)


@pytest.mark.xfail(strict=True, reason=(
    "a batch over 8 MiB (outside/held.py's KEEP_TOTAL) written in place after the call is not copied (as the update "
    "region copies none over it): defer=True names phase forward and step 1 but module 'head', no op and no line "
    "('unclassified', 'the call's inputs were modified in place since the call'), where the immediate watch names "
    "aten.log.default; copying it would hold a second batch on the device every step"))
def test_deferred_report_of_a_batch_over_8_mib_written_after_the_call() -> None:
    torch.manual_seed(0)
    model = _WideLog()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    xs = [torch.rand(4, 600_000, generator=g) + 0.5 for _ in range(3)]
    ys = [torch.randint(0, 3, (4,), generator=g) for _ in range(3)]
    xs[1][2, 77] = 0.0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=True):
        for step in range(3):
            x = xs[step].clone()
            first = model(x)
            x.add_(0.25)
            loss = F.cross_entropy(first, ys[step]) + F.mse_loss(model(x), first.detach())
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "", 1, "aten.log.default")


def test_a_rollout_writing_the_next_row_of_the_buffer_its_policy_read_keeps_no_copy() -> None:
    """A rollout's storage (PPO): ``policy(obs_buf[t])`` under no_grad, then ``obs_buf[t + 1].copy_(next_obs)``. The
    write is to another row of the buffer the call read from, which it never read: no copy (review of defer-s40:
    one copy an environment step, 48 over three updates, each held on the device under defer=True, the CUDA
    default). The update's call over ``obs_buf[:T]`` is followed by no write to it."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        policy = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        return policy, torch.optim.Adam(policy.parameters(), lr=1e-3)

    def run(policy: nn.Module, opt: torch.optim.Optimizer, kept: list[int] | None = None,
            watch: nan_magic.Watch | None = None) -> list[torch.Tensor]:
        gen, out = torch.Generator().manual_seed(1), []
        for _update in range(2):
            obs_buf = torch.zeros(9, 4, 8)
            obs_buf[0].copy_(torch.randn(4, 8, generator=gen))
            actions = []
            for t in range(8):
                with torch.no_grad():
                    actions.append(policy(obs_buf[t]).argmax(-1))
                obs_buf[t + 1].copy_(torch.tanh(obs_buf[t] + 0.1 * torch.randn(4, 8, generator=gen)))  # env step
                if watch is not None and kept is not None:
                    kept.append(sum(len(root.inputs_before) for root in watch.replays.calls))
            logp = F.log_softmax(policy(obs_buf[:8].reshape(-1, 8)), -1)
            loss = -logp.gather(1, torch.stack(actions).reshape(-1, 1)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out

    expected = run(*build())
    policy, opt = build()
    kept: list[int] = []
    with nan_magic.watch(policy, opt, defer=True) as w:
        got = run(policy, opt, kept, w)
    assert w.report is None
    assert kept == [0] * 16
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
