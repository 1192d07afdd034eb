"""A mask's rows selected whole (``logits[live]``, ``index_select`` over the batch) are still a mask to a softmax or
logsumexp over each row: it is judged as on the mask itself. Any other consumer that makes a new kind of them names
the selection (a padded time step selected whole), and an index into the masked dimension picks masked positions."""

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
         pytest.param({"mode": "full"}, id="full"), pytest.param({"ops": True}, id="ops"),
         pytest.param({"ops": True, "defer": True}, id="ops-defer")]
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


def _time_masked(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (4, 3) read time-first (T=4, B=3): sequence 1 has 2 steps, its later ones hidden with -inf."""
    valid = torch.ones(4, 3, dtype=torch.bool)
    valid[2:, 1] = False
    return logits.masked_fill(~valid, float("-inf"))


def _time_step_summed(select: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        steps = select(_time_masked(logits))
        return -steps.sum()
    return loss_of


def _last_steps(masked: torch.Tensor) -> torch.Tensor:
    # (sequence 1 has neither of the last two steps)
    return masked.index_select(0, torch.tensor([2, 3]))  # producer: by-select


def _last_steps_by_bool(masked: torch.Tensor) -> torch.Tensor:
    return masked[torch.tensor([False, False, True, True])]  # producer: by-bool


def _logsumexp_across_time(logits: torch.Tensor) -> torch.Tensor:
    steps = _last_steps(_time_masked(logits))
    return -steps.logsumexp(0).mean()


class _PaddedPool(nn.Module):
    """Max-pooling over time with the padded steps hidden (-inf), and the "last" step by an off-by-one index."""

    def __init__(self, pick: str) -> None:
        super().__init__()
        self.enc, self.head, self.pick = nn.Linear(4, 6), nn.Linear(12, 2), pick

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        pad = torch.arange(x.shape[1])[None, :] >= lengths[:, None]
        h = h.masked_fill(pad[..., None], float("-inf"))
        if self.pick == "index":
            last = h[torch.arange(x.shape[0]), lengths]  # producer: last-index
        else:
            last = h.index_select(1, lengths.max()[None]).squeeze(1)  # producer: last-select
        return self.head(torch.cat([h.max(1).values, last], -1))


@pytest.mark.parametrize("select", [_last_steps, _last_steps_by_bool], ids=["index-select", "bool-rows"])
@pytest.mark.parametrize("options", MODES)
def test_a_sum_over_time_steps_selected_whole_names_the_selection(select, options) -> None:
    # The mask is over time, not over the last dimension: selecting steps a sequence does not have is the fault.
    report = _run(_time_step_summed(select), options)
    assert (report.phase, report.module, report.step) == ("forward", None, 0)
    assert report.op == ("aten.index_select.default" if select is _last_steps else "aten.index.Tensor")
    marker = "by-select" if select is _last_steps else "by-bool"
    assert report.source is not None and report.source.lineno == marked_line(marker, where=sys.modules[__name__])


@pytest.mark.parametrize("options", MODES)
def test_a_logsumexp_across_the_selected_rows_names_the_selection(options) -> None:
    # Over the selected dimension, not along each row: the selection left sequence 1 no finite step.
    report = _run(_logsumexp_across_time, options)
    assert (report.phase, report.step, report.op) == ("forward", 0, "aten.index_select.default")
    assert report.source is not None and report.source.lineno == marked_line("by-select", where=sys.modules[__name__])


@pytest.mark.parametrize("pick", ["index", "index_select"])
@pytest.mark.parametrize("options", MODES)
def test_a_padded_step_selected_whole_then_a_matmul_names_the_selection(pick, options) -> None:
    # Whole rows of -inf (every feature of a padded step) selected by an off-by-one index, then the head's addmm:
    # the selection is named, not the head (it said "head, addmm, unclassified" while every row selection passed).
    torch.manual_seed(0)
    model = _PaddedPool(pick)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    lengths = torch.tensor([5, 3, 4])
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        loss = model(torch.randn(3, 6, 4), lengths).pow(2).mean()
        loss.backward()
    report = caught.value.report
    assert (report.phase, report.step) == ("forward", 0)
    assert report.op == ("aten.index.Tensor" if pick == "index" else "aten.index_select.default")
    marker = "last-index" if pick == "index" else "last-select"
    assert report.source is not None and report.source.lineno == marked_line(marker, where=sys.modules[__name__])
    assert report.cause is not None and report.cause.label == "masked-softmax"


@pytest.mark.parametrize("options", MODES)
def test_a_pick_out_of_rows_selected_whole_names_the_pick(options) -> None:
    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        legal = torch.ones(4, 3, dtype=torch.bool)
        legal[2, 1] = False
        rows = _by_bool(logits.log_softmax(-1).masked_fill(~legal, float("-inf")))
        picked = rows.gather(1, torch.tensor([[0], [1], [2]]))  # producer: gathered
        return -picked.sum()

    report = _run(loss_of, options)
    assert (report.phase, report.step, report.op) == ("forward", 0, "aten.gather.default")
    assert report.source is not None and report.source.lineno == marked_line("gathered", where=sys.modules[__name__])
