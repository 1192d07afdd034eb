"""Which model a report means when several are found, not given (hunt-b-s42).

A discovering ``watch()`` labels each model by the name the loop calls it by (``G``, ``D``, or ``nets[1]`` where the
call takes it from a container by constants); a model with no name of its own (``nets[i]``) by its class, numbered
from the second of that class; ``%%nantrace`` with no targets by the namespace's names, numbered the same way where two
share a class and have no name. The label is what the
report's ``model`` and its headline say.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from IPython.utils.capture import capture_output
from torch import nn

import nan_magic

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().log()


def _pair() -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 4)),
            nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 1)))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_discovered_gan_names_the_discriminator_by_its_variable(mode: str) -> None:
    G, D = _pair()
    with torch.no_grad():
        D[0].weight.zero_()
        D[0].bias.zero_()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(**MODES[mode]):
        D(G(torch.randn(5, 4))).mean().backward()
    report = caught.value.report
    assert (report.model, report.module, report.module_type, report.models_watched) == ("D", "1", "Log", 2)
    assert "1 (Log) in D" in report.message


@pytest.mark.parametrize("mode", list(MODES))
def test_a_discovered_generator_called_through_a_helper_is_named_by_its_callers_variable(mode: str) -> None:
    G, D = _pair()

    def forward(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return net(x)

    with torch.no_grad():
        G[0].weight.zero_()
        G[0].bias.zero_()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(**MODES[mode]):
        forward(D, forward(G, torch.randn(5, 4))).mean().backward()
    assert (caught.value.report.model, caught.value.report.module) == ("G", "1")


def test_two_models_of_a_list_found_by_a_notebook_cell_get_the_labels_their_calls_write(ip) -> None:
    ip.run_cell("import torch\nfrom torch import nn\nfrom test_model_labels_s42 import _pair\n"
                "nets = list(_pair())\nwith torch.no_grad():\n    nets[1][0].weight.zero_(); nets[1][0].bias.zero_()")
    ip.user_ns.pop("_nan_report", None)
    with capture_output():
        ip.run_cell("%%nantrace\nnets[1](nets[0](torch.randn(5, 4))).mean().backward()")
    report = ip.user_ns["_nan_report"]
    # (session 44: was "Sequential#2"; the cell's call takes it from the list by a constant, which says which)
    assert (report.model, report.module, report.models_watched) == ("nets[1]", "1", 2)


def test_learning_a_discovered_models_name_keeps_none_of_the_loops_tensors_alive() -> None:
    """The discriminator joins while the loop's frame holds the generator's output (its graph): reading the frame's
    names for its label must not keep that output alive for the rest of the run (a function's ``f_locals``
    snapshot, before Python 3.13)."""
    import gc
    import weakref

    G, D = _pair()
    opt = torch.optim.SGD([*G.parameters(), *D.parameters()], lr=0.1)
    with nan_magic.watch():
        for step in range(3):
            fake = G(torch.randn(3, 4))
            if step == 0:
                first = weakref.ref(fake)
            D(fake).mean().backward()
            opt.step()
            opt.zero_grad()
        del fake
        gc.collect()
        assert first() is None


def test_the_loops_tensors_are_let_go_once_torch_compile_has_run_in_the_process() -> None:
    """Once torch.compile has run, dynamo's frame evaluator stays installed and every Python call holds its arguments
    once more while it runs: a reference count of the loop's ``f_locals`` snapshot taken one call down read one too
    many, so the snapshot kept the first step's generator output for the rest of the loop (found by CI's order)."""
    compiled = torch.compile(lambda x: x + 1, backend="eager")
    assert torch.equal(compiled(torch.zeros(2)), torch.ones(2))
    test_learning_a_discovered_models_name_keeps_none_of_the_loops_tensors_alive()
