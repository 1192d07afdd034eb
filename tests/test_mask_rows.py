"""A mask's rows selected whole (``logits[live]``, ``index_select`` over the batch) are still a mask: what consumes
them is judged as it is on the mask itself; an index into the masked dimension picks masked positions one by one."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from tests.faults import marked_line

MODES = [pytest.param({}, id="default"), pytest.param({"defer": True}, id="defer"),
         pytest.param({"mode": "full"}, id="full"), pytest.param({"ops": True}, id="ops")]
ROWS = torch.tensor([0, 2, 3])


def _by_bool(masked: torch.Tensor) -> torch.Tensor:
    return masked[torch.tensor([True, False, True, True])]


def _by_index_select(masked: torch.Tensor) -> torch.Tensor:
    return masked.index_select(0, ROWS)


def _rows_then_logsumexp(select: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        legal = torch.ones(4, 3, dtype=torch.bool)
        legal[3] = False  # a state with no legal action
        rows = select(logits.masked_fill(~legal, float("-inf")))
        log_z = rows.logsumexp(-1)  # producer: rows
        return (log_z - rows[:, 0]).mean()
    return loss_of


def _pick_then_sum(logits: torch.Tensor) -> torch.Tensor:
    legal = torch.ones(4, 3, dtype=torch.bool)
    legal[1, 2] = False
    actions = torch.tensor([[0], [2], [1], [0]])  # an action the policy masked, taken from a stale buffer
    picked = logits.log_softmax(-1).masked_fill(~legal, float("-inf")).gather(1, actions)  # producer: pick
    return -picked.sum()


def _run(loss_of: Callable[[torch.Tensor], torch.Tensor], options: dict) -> nan_magic.Report:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for _ in range(2):
            loss = loss_of(model(torch.randn(4, 5)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return caught.value.report


@pytest.mark.parametrize("select", [_by_bool, _by_index_select], ids=["bool-rows", "index-select-rows"])
@pytest.mark.parametrize("options", MODES)
def test_a_logsumexp_over_a_fully_masked_row_selected_whole_is_named(select, options) -> None:
    # The row selection used to be taken for a pick of masked positions (origins.Picked) and named, at the masking
    # line, in place of the logsumexp over the row that the mask hid entirely.
    report = _run(_rows_then_logsumexp(select), options)
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 0, "aten.logsumexp.default")
    assert report.source is not None and report.source.lineno == marked_line("rows", where=sys.modules[__name__])


@pytest.mark.parametrize("options", MODES)
def test_a_gather_into_the_masked_dimension_is_still_the_pick(options) -> None:
    report = _run(_pick_then_sum, options)
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 0, "aten.gather.default")
    assert report.source is not None and report.source.lineno == marked_line("pick", where=sys.modules[__name__])
