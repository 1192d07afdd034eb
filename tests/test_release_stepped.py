"""When a step's model calls are let go: once an optimizer has stepped every trainable parameter of the model.

The optimizer's parameters are the set its layout holds (optimizer/layouts.py, made once a layout, hot17), not a
set built at every step: these pin that the release still follows the parameter list as the loop changes it (a
parameter swapped into the list in place, one taken out), a second optimizer (a GAN's), an optimizer the watch does
not check, and both timings.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 3)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("options", TIMINGS)
def test_a_call_is_let_go_once_its_models_parameters_are_stepped(options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt, **options) as w:
        for _ in range(3):
            _step(model, opt)
            assert w.replays is not None and not w.replays.calls


@pytest.mark.parametrize("options", TIMINGS)
def test_a_parameter_the_optimizer_leaves_out_keeps_the_call_waiting(options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt, **options) as w:
        _step(model, opt)
        assert w.replays is not None and not w.replays.calls
        # The list is changed in place (its object, and so any cache keyed on it, the same): the last bias out.
        del opt.param_groups[0]["params"][-1]
        _step(model, opt)
        assert [root.module for root in w.replays.calls] == [model]  # a trainable parameter no optimizer stepped


@pytest.mark.parametrize("options", TIMINGS)
def test_a_parameter_swapped_into_the_list_in_place_is_stepped_as_itself(options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt, **options) as w:
        _step(model, opt)
        # A new weight replaces the old one in the model and, in place, in the optimizer's list. The model's
        # trainable parameters are those of its first call, learned again for a call still waiting (new_step):
        # this step's call waits, the next one's goes, as the optimizer's set follows the swap.
        model[2].weight = nn.Parameter(torch.randn(1, 4) * 0.1)
        opt.param_groups[0]["params"][2] = model[2].weight
        _step(model, opt)
        assert w.replays is not None and [root.module for root in w.replays.calls] == [model]
        _step(model, opt)
        assert not w.replays.calls
        _step(model, opt)
        assert not w.replays.calls
        # And back: the old list's set is not reused for a list that holds a parameter no longer the model's.
        opt.param_groups[0]["params"][2] = nn.Parameter(torch.randn(1, 4))
        _step(model, opt)
        assert [root.module for root in w.replays.calls] == [model]


@pytest.mark.parametrize("options", TIMINGS)
def test_a_gans_generator_call_waits_for_its_own_optimizer(options: dict) -> None:
    torch.manual_seed(0)
    g, d = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.Adam(d.parameters(), lr=0.01)
    with nan_magic.watch(g, d, opt_g, opt_d, **options) as w:
        for _ in range(3):
            fake = g(torch.randn(5, 4))
            loss_d = d(fake.detach()).mean() - d(torch.randn(5, 4)).mean()
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            assert w.replays is not None and [root.module for root in w.replays.calls] == [g]
            loss_g = -d(fake).mean()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
            # The generator's call is let go; the discriminator's call since waits for its optimizer's next step.
            assert [root.module for root in w.replays.calls] == [d]


def test_an_optimizer_the_watch_does_not_check_still_releases_the_calls_it_stepped() -> None:
    torch.manual_seed(0)
    model, other = nn.Linear(3, 1), nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt_other = torch.optim.SGD(other.parameters(), lr=0.01)
    with nan_magic.watch(model, other, opt) as w:  # opt_other not passed: the checks leave it alone
        for _ in range(2):
            loss = model(torch.randn(4, 3)).pow(2).mean() + other(torch.randn(4, 3)).pow(2).mean()
            opt.zero_grad()
            opt_other.zero_grad()
            loss.backward()
            opt.step()
            assert w.replays is not None and [root.module for root in w.replays.calls] == [other]
            opt_other.step()
            assert not w.replays.calls
