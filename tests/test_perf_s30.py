"""The optimizer's gradient read in inference mode (perf-s30): the step's gradient norm is still the gradients'
norm, and the loop finds grad mode and inference mode as it left them, its tensors ordinary ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic


def _loop(create_graph: bool) -> tuple[list[float], list[float], bool, bool, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    expected = []
    with nan_magic.watch(model, opt) as watch:
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward(create_graph=create_graph)
            expected.append(math.sqrt(sum(float(p.grad.detach().double().pow(2).sum()) for p in model.parameters())))
            opt.step()
        grad_on, inferring = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        after = model(x).sum()
        after.backward()  # an ordinary tensor: autograd still records what the loop computes
        got = [summary.grad_norm for summary in watch.history]
    return expected, got, grad_on, inferring, after


@pytest.mark.filterwarnings("ignore:Using backward")
@pytest.mark.parametrize("create_graph", [False, True])
def test_the_step_gradient_norm_is_the_gradients_norm_and_the_loop_keeps_its_modes(create_graph: bool) -> None:
    expected, got, grad_on, inferring, after = _loop(create_graph)
    assert len(got) == 4
    assert got == pytest.approx(expected, rel=1e-5)
    assert grad_on and not inferring
    assert not after.is_inference() and after.requires_grad
