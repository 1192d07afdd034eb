"""Loss code that writes a tensor in place after reading it: the value now is that write's, not the data's.

``out.div_(out.detach().abs().sum(-1, keepdim=True))`` on a model's output, with a row of 0 at step 2: the loss is
inf, and the tensor the loss code read (``out.detach()``, which shares ``out``'s memory) holds the write's inf now.
It was taken for data that entered the loss code non-finite (phase data); it is the loss code's own (phase forward,
outside every module). Its op is named too, at its line: the recorder copies the output before the loss code's
``div_`` writes it (region_records.keep_before_write), and the loss code's replay starts from that copy. A label the
loss code cleans in place *before* reading it is still data.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from tests.contract import opsgaps15
from tests.faults import marked_line

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]
MODES = [*TIMINGS, pytest.param({"mode": "full"}, id="full")]


@pytest.mark.parametrize("options", MODES)
def test_a_tensor_the_loss_code_wrote_after_reading_it_is_not_data(options: dict) -> None:
    # The contract table's case (tests/contract/opsgaps15.py), asserted here on what the table does not check.
    scenario = opsgaps15.in_place_on_a_model_output()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options):
        scenario.run()
    report = caught.value.report
    assert (report.phase, report.module, report.step) == ("forward", None, 2), report.message
    # (the div_'s own output, as for any op of the loss code the replay names)
    assert (report.op, report.tensor.role.value) == ("aten.div_.Tensor", "op output")
    assert report.source is not None
    assert report.source.lineno == marked_line("in-place scale", where=opsgaps15)


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


@pytest.mark.parametrize(("loss_code", "asked", "copied"), [
    pytest.param("none", 0, 0, id="no-write"),
    # (a zero_grad bound before the watch runs without the patch that steps the recorder aside: it writes the
    # gradients in the loss code; they are not copied)
    pytest.param("zero_grad", None, 0, id="bound-zero-grad-not-to-none"),  # (asked per write: foreach or not)
    pytest.param("div_", 3, 3, id="write"),
])
def test_only_a_loss_code_that_writes_its_output_in_place_pays_for_a_copy(monkeypatch, loss_code: str,
                                                                          asked: int | None, copied: int) -> None:
    # The recorder copies a model's output before the loss code writes it in place; a loss with no in-place op asks
    # nothing, and the gradients zero_grad(set_to_none=False) writes in the loss code are not copied.
    from nan_magic.localize.outside.region_records import RegionRecords

    calls: list[int] = []
    keep = RegionRecords.keep_before_write

    def counted(self: RegionRecords, *args: object) -> None:
        had = len(self.before)
        keep(self, *args)  # type: ignore[arg-type]
        calls.append(len(self.before) - had)

    monkeypatch.setattr(RegionRecords, "keep_before_write", counted)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    zero_grad = opt.zero_grad
    with nan_magic.watch(model, opt) as watch:
        for step in range(3):
            out = model(torch.randn(5, 4))
            if loss_code == "div_":
                out.div_(2.0)
            loss = out.pow(2).mean()
            zero_grad(set_to_none=loss_code != "zero_grad" or step == 0)  # (step 0: no gradient to zero yet)
            loss.backward()
            opt.step()
    assert watch.report is None
    assert (len(calls) if asked is not None else bool(calls), sum(calls)) == (
        asked if asked is not None else True, copied)
