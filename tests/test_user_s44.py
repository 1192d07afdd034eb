"""What session 44's notebook users found, in-process, in every mode (tests/test_user_s44_notebooks.py runs them in a
kernel).

A loop that regresses the logit of a click-through rate meets a rate of 1.0: the loop's own line made the +inf from
the data alone, phase ``data``. The report said "every watched module output of this step was finite: code outside
the modules (the loss) produced it", the loss check's note, kept when the finding moved to phase data; the same for a
target a Dataset's ``__getitem__`` builds, whose report also said "no fix was tried: the producer ran in the loss
code". Two models kept in a dict (``parts['decoder'](parts['encoder'](x))``) were labelled by their class,
``Sequential`` and ``Sequential#2``, or by a loop variable an earlier cell left bound to one (``in part``): they are
named as the loop's call takes them, ``parts['decoder']``. Each with its healthy twin, silent and bit-identical.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import nan_magic
from nan_magic.render.text import render_text

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}
DATA_NOTE = ("every watched module output of this step was finite: code outside the modules made it from the data "
             "alone (a target or an input it built), not from a model's output")


def _rates(eps: float = 0.0) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    views = torch.randint(3, 500, (100,)).float()
    clicks = torch.floor(views * torch.rand(100) * 0.2) + 1
    views[57], clicks[57] = 3.0, 3.0  # every view clicked: a rate of 1, whose logit is +inf
    return model, torch.optim.RMSprop(model.parameters(), lr=1e-3), torch.randn(100, 8), clicks / views


def _train_on_logits(model: nn.Module, opt: torch.optim.Optimizer, feats: torch.Tensor, ctr: torch.Tensor,
                     eps: float | None) -> list[float]:
    losses = []
    for i in range(0, 100, 25):
        target = torch.logit(ctr[i:i + 25], eps=eps).unsqueeze(1)  # producer: the loop's logit
        loss = F.mse_loss(model(feats[i:i + 25]), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _notes(report: Any) -> list[str]:
    return [note.kind for note in report.note_facts]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_target_the_loop_built_from_a_rate_of_one_is_the_datas_not_the_losss(mode: str) -> None:
    model, opt, feats, ctr = _rates()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        _train_on_logits(model, opt, feats, ctr, eps=None)
    report = caught.value.report
    assert (report.phase, report.module, report.op, report.step) == ("data", None, "aten.logit.default", 2)
    assert report.source is not None and report.source.line.startswith("target = torch.logit(")
    assert (report.posinf, report.numel) == (1, 25)
    assert "outside-made-it" not in _notes(report)
    text = render_text(report)
    assert "(the loss) produced it" not in text
    if "data-code-made-it" in _notes(report):  # (a mode that judged the loss first, then found the loop's op)
        assert DATA_NOTE in text


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_the_default_watch_says_the_data_code_made_the_target(mode: str) -> None:
    model, opt, feats, ctr = _rates()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        _train_on_logits(model, opt, feats, ctr, eps=None)
    assert "data-code-made-it" in _notes(caught.value.report)
    assert DATA_NOTE in render_text(caught.value.report)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_clamped_logit_twin_is_silent_and_bit_identical(mode: str) -> None:
    model, opt, feats, ctr = _rates()
    unwatched = _train_on_logits(model, opt, feats, ctr, eps=1e-6)
    model, opt, feats, ctr = _rates()
    with nan_magic.watch(model, opt, **MODES[mode]) as watch:
        watched = _train_on_logits(model, opt, feats, ctr, eps=1e-6)
    assert watch.report is None and watched == unwatched


class LogOdds(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Ad slots whose target, the logit of the slot's rate, is built in ``__getitem__``."""

    def __init__(self, eps: float | None) -> None:
        _model, _opt, self.feats, self.ctr = _rates()
        self.eps = eps

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.feats[index], torch.logit(self.ctr[index], eps=self.eps).reshape(1)


def _train_from(dataset: LogOdds, model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    losses = []
    for x, y in DataLoader(dataset, batch_size=25):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", list(MODES))
def test_a_target_a_datasets_getitem_built_is_the_datas_not_the_losss(mode: str) -> None:
    model, opt, _feats, _ctr = _rates()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        _train_from(LogOdds(eps=None), model, opt)
    report = caught.value.report
    assert (report.phase, report.op, report.step) == ("data", "aten.logit.default", 2)
    assert report.source is not None and report.source.function == "__getitem__"
    text = render_text(report)
    assert "outside-made-it" not in _notes(report) and "(the loss) produced it" not in text
    # no trial could run the Dataset's code again: said of the code that built the data, not of the loss code
    assert "fixes-no-data-code" in _notes(report) and "the producer ran in the loss code" not in text
    assert "no fix was tried: the producer ran in code that built the data (a target, an input), which the trials " \
           "could not run again: " in text
    model, opt, _feats, _ctr = _rates()
    unwatched = _train_from(LogOdds(eps=1e-6), model, opt)
    model, opt, _feats, _ctr = _rates()
    with nan_magic.watch(model, opt, **MODES[mode]) as watch:
        assert _train_from(LogOdds(eps=1e-6), model, opt) == unwatched
    assert watch.report is None


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.log()


#: The calling line's source span (co_positions) names a model taken from a container: Python 3.11 on.
NEEDS_POSITIONS = pytest.mark.skipif(sys.version_info < (3, 11), reason="co_positions is Python 3.11's")


def _parts(dead: bool) -> dict[str, nn.Sequential]:
    torch.manual_seed(0)
    parts = {"encoder": nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "decoder": nn.Sequential(nn.Linear(4, 4), Log())}
    with torch.no_grad():
        parts["decoder"][0].bias.fill_(-10.0 if dead else 10.0)  # dead: every input of the log negative
    return parts


def _autoencode(parts: dict[str, nn.Sequential]) -> list[float]:
    opts = [torch.optim.SGD(part.parameters(), lr=1e-3) for part in parts.values()]
    losses = []
    for _step in range(3):
        loss = parts["decoder"](parts["encoder"](torch.randn(5, 4))).sum()
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        for opt in opts:
            opt.step()
        losses.append(loss.item())
    return losses


@NEEDS_POSITIONS
@pytest.mark.parametrize("mode", list(MODES))
def test_a_model_kept_in_a_dict_is_named_as_the_loop_takes_it(mode: str) -> None:
    """Was "1 (Log) in Sequential#2": two models of one class in a dict, with no name of their own, by their class."""
    parts = _parts(dead=True)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(**MODES[mode]):
        _autoencode(parts)
    report = caught.value.report
    assert (report.model, report.module, report.step) == ("parts['decoder']", "1", 0)
    assert report.message.startswith("first non-finite value in forward step 0: 1 (Log) in parts['decoder']")


@NEEDS_POSITIONS
@pytest.mark.parametrize("mode", ["default", "ops"])
def test_a_loop_variable_left_bound_to_a_model_does_not_name_it(mode: str) -> None:
    """Was "in part": the name the last ``for name, part in parts.items()`` left bound to the decoder."""
    parts = _parts(dead=True)
    for _name, part in parts.items():
        part.train()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(**MODES[mode]):
        parts["decoder"](parts["encoder"](torch.randn(5, 4))).sum().backward()
    assert caught.value.report.model == "parts['decoder']" and part is parts["decoder"]


def test_a_model_taken_by_a_variable_index_or_by_its_name_is_named_as_before() -> None:
    parts = _parts(dead=True)
    nets = list(parts.values())
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch():
        for i in range(2):
            nets[i](torch.randn(5, 4)).sum().backward()
    assert caught.value.report.model == "Sequential#2"  # (nets[i]: no constant says which)
    decoder = _parts(dead=True)["decoder"]
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch():
        decoder(torch.randn(5, 4)).sum().backward()
    assert caught.value.report.model == "decoder"


@pytest.mark.parametrize("mode", list(MODES))
def test_the_healthy_dict_of_modules_is_silent_and_bit_identical(mode: str) -> None:
    unwatched = _autoencode(_parts(dead=False))
    parts = _parts(dead=False)
    with nan_magic.watch(**MODES[mode]) as watch:
        assert _autoencode(parts) == unwatched
    assert watch.report is None


@pytest.mark.parametrize("line", ["%nanwatch on --mode full", "%nanwatch --mode=full", "%%nantrace --mode full\npass"])
def test_watchs_mode_keyword_written_as_an_option_points_to_full(ip, line: str) -> None:
    """``mode="full"`` is watch()'s; the magics' flag is ``--full``. Was only "unrecognized arguments: --mode; the
    options are ..."."""
    from IPython.core.error import UsageError
    from IPython.utils.capture import capture_output

    with capture_output() as said:
        result = ip.run_cell(line)
    error = result.error_in_exec or result.error_before_exec
    assert isinstance(error, UsageError), error
    assert " (did you mean --full? watch()'s mode=\"full\" is --full here); the options are --defer, " in str(error)
    assert "\n" not in str(error) and said.stdout == ""
    with capture_output() as status:
        ip.run_line_magic("nanwatch", "status")
    assert status.stdout.splitlines()[0] == "nan_magic: off"  # nothing attached
