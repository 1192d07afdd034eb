"""What a boundary's probe must keep, whatever it does before its reduction (hot17, issue 25).

hot17 tried detaching only a tensor that requires grad (a batch and a gradient read as they are, one tensor
object less a read) and left it: sampled, the time moved from the detach to the reduction, the step's first touch
of the tensor (benchmarks/README.md, "seventeenth round"). These pin what such a change must keep: no read
records a graph, the values read are the same, and a batch that is a forward-mode dual tensor (no grad
required, a tangent carried) is read as its primal values, in both timings.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import nan_magic
from nan_magic.hot.reads import probe

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("numel", [64, 1 << 19])  # aminmax, and the amin/amax pair of a mid-sized CPU tensor
def test_a_probe_records_no_graph_and_reads_the_range(requires_grad: bool, numel: int) -> None:
    torch.manual_seed(0)
    leaf = torch.randn(numel, requires_grad=requires_grad)
    tensor = leaf * 2 if requires_grad else leaf
    low, high = probe(tensor)
    assert low.grad_fn is None and high.grad_fn is None
    assert not low.requires_grad and not high.requires_grad
    assert (float(low), float(high)) == (float(tensor.detach().min()), float(tensor.detach().max()))


@pytest.mark.parametrize("options", TIMINGS)
def test_a_forward_mode_dual_batch_is_read_as_its_primal(options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    primal = torch.randn(6, 4) * 3
    with nan_magic.watch(model, opt, **options) as w, fwAD.dual_level():
        for _ in range(3):
            x = fwAD.make_dual(primal, torch.full_like(primal, 1e30))  # a tangent no read may take for the value
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert w.report is None and len(w.history) == 3
    assert all(row.input_absmax == float(primal.abs().max()) for row in w.history)


@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_in_a_batch_that_needs_no_grad_is_still_seen_as_data(options: dict) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert caught.value.report.phase == "data"
