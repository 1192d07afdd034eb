"""Loss code that writes a tensor in place after reading it: the value now is that write's, not the data's.

``out.div_(out.detach().abs().sum(-1, keepdim=True))`` on a model's output, with a row of 0 at step 2: the loss is
inf, and the tensor the loss code read (``out.detach()``, which shares ``out``'s memory) holds the write's inf now.
It was taken for data that entered the loss code non-finite (phase data); it is the loss code's own (phase forward,
outside every module). Its op is named only in ops mode (tests/contract/opsgaps15.py says why). A label the loss
code cleans in place *before* reading it is still data.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]
MODES = [*TIMINGS, pytest.param({"mode": "full"}, id="full")]


def _in_place_on_the_output(options: dict) -> nan_magic.Report:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            out = model(torch.randn(5, 4))
            size = out.detach().abs().sum(-1, keepdim=True) * ((torch.arange(5) > 0) | (step != 2)).unsqueeze(-1)
            out.div_(size)
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return caught.value.report


@pytest.mark.parametrize("options", MODES)
def test_a_tensor_the_loss_code_wrote_after_reading_it_is_not_data(options: dict) -> None:
    report = _in_place_on_the_output(options)
    assert (report.phase, report.module, report.step) == ("forward", None, 2), report.message
    assert report.tensor.role.value == "loss"


@pytest.mark.parametrize("options", TIMINGS)
def test_a_label_cleaned_in_place_before_the_loss_reads_it_is_still_data(options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            y = torch.randn(5, 1)
            if step == 2:
                y[1] = float("nan")
            y.clamp_(-3, 3)  # (keeps the NaN)
            loss = F.mse_loss(model(torch.randn(5, 4)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step) == ("data", None, 2), report.message
