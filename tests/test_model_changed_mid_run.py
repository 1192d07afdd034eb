"""A model whose structure changes while the watch runs: a layer appended or swapped in, one frozen, a param group
added (progressive unfreezing). Each is named as ``named_modules()`` names it at the step it fails, in every mode.

The watch names a model's modules when it begins (hot/watched/targets.py); a submodule added since is named the
first time it is called inside a watched call (``Targets.adopt``). Before, ``ops=True`` and ``mode="full"`` named
its NaN as its parent's own code (the root, ``""``), while the default watch's replay found it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from tests.watching import FIVE_MODES as MODES
from tests.watching import LogWhenTold


def _train(model: nn.Module, opt: torch.optim.Optimizer, options: dict, change: object, steps: int = 10) -> None:
    with nan_magic.watch(model, opt, **options):
        for step in range(steps):
            change(step)  # type: ignore[operator]
            loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


def _assert_named(report: nan_magic.Report, options: dict, module: str, step: int) -> None:
    assert (report.phase, report.module, report.module_type, report.step) == ("forward", module, "LogWhenTold", step)
    if options.get("ops") or options.get("mode") == "full":
        assert report.op == "aten.log.default"


@pytest.mark.parametrize("options", MODES)
def test_a_layer_swapped_in_mid_run_is_named_at_its_place(options) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def change(step: int) -> None:
        if step == 4:
            model[1] = LogWhenTold()
        if step >= 4:
            model[1].fire = step == 6

    with pytest.raises(NonFiniteError) as caught:
        _train(model, opt, options, change)
    _assert_named(caught.value.report, options, "1", 6)


@pytest.mark.parametrize("options", MODES)
def test_a_layer_appended_mid_run_is_named_at_its_place(options) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def change(step: int) -> None:
        if step == 3:
            model.append(nn.Sequential(nn.Identity(), LogWhenTold()))  # a subtree: its inner module is named too
        if step >= 3:
            model[3][1].fire = step == 6

    with pytest.raises(NonFiniteError) as caught:
        _train(model, opt, options, change)
    _assert_named(caught.value.report, options, "3.1", 6)


@pytest.mark.parametrize("options", MODES)
def test_a_module_outside_the_model_called_inside_it_stays_its_parents_code(options) -> None:
    # A module kept in a plain list is no submodule (nn.Module does not register it): its ops are the parent's.
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.unregistered = [LogWhenTold()]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.unregistered[0](self.lin(x))

    torch.manual_seed(0)
    model = nn.Sequential(Parent(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def change(step: int) -> None:
        model[0].unregistered[0].fire = step == 5

    with pytest.raises(NonFiniteError) as caught:
        _train(model, opt, options, change)
    report = caught.value.report
    assert (report.phase, report.module, report.module_type, report.step) == ("forward", "0", "Parent", 5)


@pytest.mark.parametrize("options", MODES)
def test_progressive_unfreezing_a_param_group_added_mid_run_is_checked(options) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model[2].requires_grad_(False)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.01)

    def change(step: int) -> None:
        if step == 5:
            model[2].requires_grad_(True)
            opt.add_param_group({"params": model[2].parameters(), "lr": 0.01})
        if step == 7:
            opt.param_groups[1]["lr"] = float("inf")

    with pytest.raises(NonFiniteError) as caught:
        _train(model, opt, options, change)
    report = caught.value.report
    assert (report.phase, report.module, report.step) == ("optimizer", "2", 7)
    assert report.tensor.name in ("2.weight", "2.bias")


@pytest.mark.parametrize("passed", [True, False], ids=["optimizer-passed", "model-only"])
@pytest.mark.parametrize("options", MODES)
def test_an_optimizer_switched_mid_run_is_watched_and_counts_the_steps(options, passed: bool) -> None:
    # Adam for five steps, then SGD over the same parameters; SGD's learning rate is inf at iteration 6. The new
    # optimizer was not passed to the watch: it joins because it steps a watched model's parameters, and it takes
    # Adam's place in the iteration count (before: unwatched when Adam was passed, so the parameter was first seen
    # in the next forward; and the step read 5, as if SGD's first step belonged to Adam's last iteration).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizers = [torch.optim.Adam(model.parameters(), lr=0.01)]
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, *optimizers[:passed], **options):
        for step in range(10):
            if step == 5:
                optimizers.append(torch.optim.SGD(model.parameters(), lr=0.01))
            optimizers[-1].param_groups[0]["lr"] = float("inf") if step == 6 else 0.01
            loss = model(torch.randn(3, 4)).pow(2).mean()
            optimizers[-1].zero_grad()
            loss.backward()
            optimizers[-1].step()
    report = caught.value.report
    assert (report.phase, report.module, report.step) == ("optimizer", "0", 6)
    assert report.tensor.role.value == "parameter"


@pytest.mark.parametrize("options", MODES)
def test_after_an_optimizer_switch_a_forward_nan_has_the_loops_iteration(options) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogWhenTold(), nn.Linear(4, 1))
    optimizers = [torch.optim.Adam(model.parameters(), lr=0.01)]
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, optimizers[0], **options):
        for step in range(12):
            if step == 5:
                optimizers.append(torch.optim.SGD(model.parameters(), lr=0.01))
            model[1].fire = step == 8
            loss = model(torch.randn(3, 4)).pow(2).mean()
            optimizers[-1].zero_grad()
            loss.backward()
            optimizers[-1].step()
    _assert_named(caught.value.report, options, "1", 8)


def test_a_module_freed_mid_run_takes_its_name_with_it() -> None:
    """A layer swapped out and freed leaves its id to the next object made, often another module (every module
    instance is one size): the id must not keep the freed layer's name and type, or that module would be named as
    the freed one ("1 (Tanh)"); a weak reference's callback drops it as the module is freed (Targets.named)."""
    import gc

    from nan_magic.hot.watched.targets import resolve_targets
    from nan_magic.options import WatchConfig

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    targets = resolve_targets([model], None, WatchConfig())
    freed = id(model[1])
    assert targets.modules[freed].module_type == "Tanh"
    model[1] = LogWhenTold()
    gc.collect()
    assert freed not in targets.modules and freed not in targets.named
    kept = model[0]
    assert targets.modules[id(kept)].name == "0"  # a module still alive keeps its name
    assert {info.name for info in targets.infos()} == {"", "0", "2"}
