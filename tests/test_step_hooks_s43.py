"""The user's optimizer step hooks under the watch (patches/step_hooks.py): seated beside them, never reordering them.

The contract rows (tests/contract/hunt_s43_defer_hooks.py) assert what the report says in every mode; these assert
what the user's optimizer looks like during and after the watch, and that a hooked healthy run computes the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError


def _model_and_opt() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3, reset: int | None = None
           ) -> list[torch.Tensor]:
    ids, ys = torch.tensor([1, 2, 3, 4]), torch.ones(4, 1)
    losses = []
    for step in range(steps):
        if step == reset:
            with torch.no_grad():
                model[0].weight[5] = 0.0
        loss = F.mse_loss(model(ids), ys)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("defer", [False, True])
def test_hooks_run_in_the_users_order_and_are_the_users_alone_after(defer: bool) -> None:
    """Three hooks of the user's (two post, one pre) and one added mid-run run in the user's order every step; the
    watch's seated hooks are gone after, the user's hook dicts as they were."""
    model, opt = _model_and_opt()
    calls: list[str] = []

    def hook(name: str) -> Any:
        return lambda o, args, kwargs: calls.append(name)

    opt.register_step_pre_hook(hook("pre"))
    opt.register_step_post_hook(hook("post1"))
    opt.register_step_post_hook(hook("post2"))
    pre_keys, post_keys = list(opt._optimizer_step_pre_hooks), list(opt._optimizer_step_post_hooks)
    with nan_magic.watch(model, opt, defer=defer):
        _train(model, opt, steps=1)
        late = opt.register_step_post_hook(hook("post3"))
        _train(model, opt, steps=2)
    assert calls == ["pre", "post1", "post2"] + ["pre", "post1", "post2", "post3"] * 2
    late.remove()
    assert list(opt._optimizer_step_pre_hooks) == pre_keys
    assert list(opt._optimizer_step_post_hooks) == post_keys


@pytest.mark.parametrize("defer", [False, True])
def test_a_hooked_healthy_run_computes_the_same(defer: bool) -> None:
    """A max-norm projection after every step, watched and not: the same losses and weights, bit for bit."""

    def run(watched: bool) -> list[torch.Tensor]:
        model, opt = _model_and_opt()

        def project(o: Any, args: Any, kwargs: Any) -> None:
            with torch.no_grad():
                model[0].weight /= model[0].weight.norm(dim=1, keepdim=True).clamp_min(1e-12)

        opt.register_step_post_hook(project)
        if not watched:
            return [*_train(model, opt, steps=4), *model.parameters()]
        with nan_magic.watch(model, opt, defer=defer) as w:
            out = [*_train(model, opt, steps=4), *model.parameters()]
        assert w.report is None
        return out

    for got, expected in zip(run(True), run(False), strict=True):
        assert torch.equal(got.detach(), expected.detach())


@pytest.mark.parametrize("defer", [False, True])
def test_a_post_hook_projection_at_a_bounded_step_is_named_at_that_step(defer: bool) -> None:
    """Step 3 is a bounded SGD step whose parameter check the watch skips (not a 16th): the post-hook that makes a
    reset row 0 / 0 is still found at step 3, as the optimizer phase, by its op and line. (Before, the next forward
    met the parameter: phase data, step 4, "written outside the optimizer", no op.)"""
    model, opt = _model_and_opt()

    def project(o: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            table = model[0].weight
            table /= table.norm(dim=1, keepdim=True)  # the projection

    opt.register_step_post_hook(project)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        _train(model, opt, steps=6, reset=3)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("optimizer", "0", 3, "aten.div_.Tensor")
    assert report.source is not None and report.source.line.strip().endswith("# the projection")
    assert report.cause is not None and report.cause.label == "division-by-zero"
    assert "outside the optimizer" not in report.to_text()


@pytest.mark.parametrize("defer", [False, True])
def test_a_post_hook_that_runs_many_ops_leaves_the_data_code_its_budget(defer: bool) -> None:
    """A post-hook logging two statistics of each of 42 parameters (84 ops, past the data region's budget of 64) runs
    in the data region the step's check begins; it writes no parameter, so the region starts afresh after it, and the
    loop's standardisation of a constant feature at step 3 is still named by its op and line. (Seated without that,
    the hook's ops put the data region over budget for good: op None.)"""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)], nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    stats: list[list[torch.Tensor]] = []

    def log_statistics(o: Any, args: Any, kwargs: Any) -> None:
        stats.append([p.detach().norm() for p in model.parameters()])
        stats.append([p.detach().abs().max() for p in model.parameters()])

    opt.register_step_post_hook(log_statistics)
    raw, ys = [torch.randn(8, 4) for _ in range(5)], [torch.randn(8, 1) for _ in range(5)]
    raw[3][:, 1] = 2.0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        for step in range(5):
            x = (raw[step] - raw[step].mean(0)) / raw[step].std(0)  # the standardise
            loss = F.mse_loss(model(x), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", 3, "aten.div.Tensor")
    assert report.source is not None and report.source.line.strip().endswith("# the standardise")


@pytest.mark.parametrize("config", [{}, {"defer": True}, {"mode": "full"}], ids=["default", "defer", "full"])
def test_a_post_hook_that_writes_every_layer_leaves_the_data_code_its_budget(config: dict[str, Any]) -> None:
    """A healthy max-norm constraint over 21 layers' weights in a post-hook (84 ops, past the data region's budget of
    64) writes parameters at every step; the loop's standardisation of a constant feature at step 3 is still named by
    its op and line. (With the region started afresh only after hooks that wrote nothing, their ops put it over
    budget for good: op None, no line; review D2.)"""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)], nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def max_norm(o: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(1.0 / p.norm(dim=1, keepdim=True).clamp_min(1.0))

    opt.register_step_post_hook(max_norm)
    raw, ys = [torch.randn(8, 4) for _ in range(5)], [torch.randn(8, 1) for _ in range(5)]
    raw[3][:, 1] = 2.0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **config):
        for step in range(5):
            x = (raw[step] - raw[step].mean(0)) / raw[step].std(0)  # the standardise
            loss = F.mse_loss(model(x), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", 3, "aten.div.Tensor")
    assert report.source is not None and report.source.line.strip().endswith("# the standardise")


@pytest.mark.parametrize("defer", [False, True])
def test_hook_dicts_cleared_by_the_loop_are_seated_afresh(defer: bool) -> None:
    """The loop clears the optimizer's (private) hook dicts after step 0, the watch's seated hooks with them, then
    registers a projection at step 1: no error from the watch (a KeyError from the seat's move before, review D3),
    and the projection's 0 / 0 at step 3 is still named at that step by its op; after the watch, only the user's hook
    is left."""
    model, opt = _model_and_opt()
    opt.register_step_post_hook(lambda o, args, kwargs: None)

    def project(o: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            table = model[0].weight
            table /= table.norm(dim=1, keepdim=True)  # the projection

    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        _train(model, opt, steps=1)
        opt._optimizer_step_post_hooks.clear()
        opt._optimizer_step_pre_hooks.clear()
        _train(model, opt, steps=1)
        opt.register_step_post_hook(project)
        _train(model, opt, steps=4, reset=1)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("optimizer", "0", 3, "aten.div_.Tensor")
    assert report.source is not None and report.source.line.strip().endswith("# the projection")
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 1
