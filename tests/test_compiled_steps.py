"""A ``torch.compile``d optimizer step (``@torch.compile def step(): opt.step()``, a documented recipe) and loss
under the watch: nothing of the watch's in what dynamo traces, compiles, warns or logs, and a NaN born in the
compiled step is named as in an eager one (patches/step_hooks.py).
"""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
from contract import MODE_OPTIONS
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402 - after the skip


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _compiled_training(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 4) -> list[torch.Tensor]:
    x, y = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(6, 2)

    @torch.compile(backend="eager")
    def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.smooth_l1_loss(out, target) + 0.01 * out.pow(2).mean()

    @torch.compile(backend="eager")
    def step() -> None:
        opt.step()

    losses = []
    for _ in range(steps):
        loss = loss_of(model(x), y)
        opt.zero_grad()
        loss.backward()
        step()
        losses.append(loss.detach())
    return losses


def _ours(records: dict[str, int]) -> list[str]:
    return [record.splitlines()[0] for record in records if "nan_magic" in record]


@pytest.mark.parametrize("mode", ["default", "full", "defer"])
def test_a_compiled_optimizer_step_and_loss_leave_no_trace_of_the_watch(mode: str) -> None:
    """Before: dynamo traced the watch's step hooks and the update recorder's dispatch frames (graph breaks naming
    ``_nan_magic_update``, hot/reads.py's ``is_checkable`` compiled to its recompile limit, with a warning), and
    in defer mode a guard kept a second weak reference on every parameter (the unwatched run holds one)."""
    plain = _mlp()
    expected = _compiled_training(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    dynamo.reset()
    counters.clear()
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
            got = _compiled_training(model, opt)
    assert w.report is None and w.events == []
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    ours = [str(w.message) for w in caught if "nan_magic" in f"{w.filename} {w.message}"]
    assert ours == []
    assert _ours(counters["graph_break"]) == [] and _ours(counters["unimplemented"]) == []
    assert not any("recompile_limit" in record or "Recompile limit" in record for record in counters["unimplemented"])
    assert [weakref.getweakrefcount(p) for p in model.parameters()] == [
        weakref.getweakrefcount(p) for p in plain.parameters()]


def test_an_eager_loop_keeps_the_bare_step_hooks() -> None:
    """The dynamo-opaque wrappers cost three calls a hook: swapped in only once dynamo compiles something."""
    from torch.optim import optimizer as optimizers

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nan_magic.watch(model, opt):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        hooks = [*optimizers._global_optimizer_pre_hooks.values(), *optimizers._global_optimizer_post_hooks.values()]
        assert not any(getattr(hook, "_torchdynamo_disable", False) for hook in hooks)
        torch.compile(lambda t: t * 2, backend="eager")(torch.ones(2))
        hooks = [*optimizers._global_optimizer_pre_hooks.values(), *optimizers._global_optimizer_post_hooks.values()]
        assert all(getattr(hook, "_torchdynamo_disable", False) for hook in hooks)
    assert not optimizers._global_optimizer_pre_hooks and not optimizers._global_optimizer_post_hooks


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_a_nan_born_in_a_compiled_optimizer_step_names_the_phase_parameter_and_step(mode: str) -> None:
    """AdamW with eps=0 divides 0 by 0 where a gradient is zero (an output the loss masks out)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0)
    mask, x = torch.tensor([1.0, 1.0, 0.0]), torch.randn(5, 4)

    @torch.compile(backend="eager")
    def step() -> None:
        opt.step()

    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]):
        for _ in range(3):
            loss = (model(x) * mask).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            step()
    report = caught.value.report
    assert (report.phase, report.step, report.tensor.role.value, report.tensor.name) == (
        "optimizer", 0, "parameter", "2.weight")
    assert report.op == "aten.addcdiv_.default"


@pytest.mark.parametrize("mode", ["ops", "ops-defer"])
def test_ops_mode_runs_a_compiled_optimizer_step_eagerly_bit_identical_to_an_eager_run(mode: str) -> None:
    """As a compiled model under ops=True (test_compiled.py): the op tracer sees every op of the step, so dynamo
    runs it eagerly; the result is the unwatched eager run's, not the compiled one's (AdamW's bias corrections are
    Python floats eagerly, tensors compiled: the last bits differ; the contract row's strict xfail)."""
    plain = _mlp()
    with torch.compiler.set_stance("force_eager"):
        expected = _compiled_training(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    dynamo.reset()
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
        got = _compiled_training(model, opt)
    assert w.report is None and w.events == []
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
