"""A model compiled with torch.compile(mode="reduce-overhead") trained on CPU under the watch (calm_s30), every
mode: on CPU there are no CUDA graphs to record, so inductor falls back to its ordinary compiled code; the watch
sees the compiled module's outputs and its optimizer and must change nothing (tests/calm_s30.py: the harness)."""

from __future__ import annotations

import pytest
import torch
from calm_s30 import MODES, Row, check, steps
from torch import nn
from torch.nn import functional as F

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)

EAGER = (
    "by design, under mode='full' and ops=True a compiled model runs eagerly while watched and the watch warns "
    "'nan_magic: Sequential is compiled with torch.compile; ... runs eagerly'; the eager parameters then differ in "
    "their last bits from the compiled unwatched run")


def reduce_overhead() -> Row:
    torch._dynamo.reset()  # (each run compiles afresh: what a run leaves in dynamo's caches is not the next one's)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    compiled = torch.compile(model, mode="reduce-overhead")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    return Row((compiled, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(compiled(x), y)))


@pytest.mark.parametrize("mode", [
    pytest.param(mode, marks=[] if mode in ("default", "defer") else pytest.mark.xfail(strict=True, reason=EAGER))
    for mode in MODES])
def test_reduce_overhead_compiled_model_is_calm_and_identical(mode: str) -> None:
    """The watch, the model and its optimizer are freed once dropped (Dynamo's own weak tag on every module made
    after its first compile, watched or not, is not counted: tests/calm_s29.py)."""
    check(reduce_overhead, mode, all_freed=True)
