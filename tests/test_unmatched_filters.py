"""``include`` / ``types`` that match no module: one warning line naming them and what exists, never an error.

Round 18: ``--include 'encodr.*'`` (a typo) watched nothing but the model's input, and said nothing: the user
thought the run was watched.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from IPython.utils.capture import capture_output
from torch import nn

import nan_magic
from nan_magic import NanMagicWarning


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, NanMagicWarning)]


def test_watch_warns_at_its_start_for_an_include_pattern_that_matches_nothing() -> None:
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nan_magic.watch(model, include=["encodr.*"]):
            at_start = _messages(caught)
            model(torch.randn(2, 4))
    assert at_start == [
        "nan_magic: include pattern 'encodr.*' matches no module of the watched models, so nothing it meant is "
        "checked (their module names: encoder, encoder.0, encoder.1, head)"
    ]
    assert caught[0].filename == __file__  # at the user's line, not in nan_magic


def test_watch_warns_for_a_type_that_no_module_has_and_not_for_the_ones_that_match() -> None:
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nan_magic.watch(model, types=["Linaer", "ReLU"], include=["encoder.*", "head"]):
            model(torch.randn(2, 4))
    assert _messages(caught) == [
        "nan_magic: types entry 'Linaer' matches no module of the watched models, so nothing it meant is "
        "checked (their module types: Sequential, Linear, ReLU)"
    ]


def test_a_matching_filter_says_nothing_and_a_watch_without_filters_neither() -> None:
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nan_magic.watch(model, include=["encoder.*"], types=[nn.Linear]):
            model(torch.randn(2, 4))
        with nan_magic.watch(model):
            model(torch.randn(2, 4))
    assert _messages(caught) == []


def test_an_unmatched_pattern_still_stops_at_a_nan_in_the_data(ip) -> None:
    """A warning, not an error: the watch runs on and still catches what enters the model."""
    model = Net()
    with warnings.catch_warnings(record=True) as caught, pytest.raises(nan_magic.NonFiniteError) as raised:
        warnings.simplefilter("always")
        with nan_magic.watch(model, include=["nothing"]):
            model(torch.full((2, 4), float("nan")))
    assert raised.value.report.phase == "data"
    assert len(_messages(caught)) == 1


@pytest.mark.parametrize("targets", ["model ", ""])
def test_the_magic_warns_once_per_unmatched_filter_and_runs_the_cell(ip, targets: str) -> None:
    """(In a kernel the lines go to the cell's stderr: tests/test_nb18.py.)"""
    ip.user_ns["model"] = Net()
    ip.user_ns["torch"] = torch
    with warnings.catch_warnings(record=True) as caught, capture_output():
        warnings.simplefilter("default")
        result = ip.run_cell(f"%%nantrace {targets}--include 'encodr.*' --types Linaer\nran = model(torch.randn(2, 4))")
        # said again when the cell runs again (a plain warnings.warn says a line once)
        ip.run_cell(f"%%nantrace {targets}--include 'encodr.*'\nran = model(torch.randn(2, 4))")
    assert result.success and "ran" in ip.user_ns
    lines = _messages(caught)
    assert len(lines) == 3, lines
    assert "include pattern 'encodr.*' matches no module" in lines[0]
    assert "(their module names: encoder, encoder.0, encoder.1, head)" in lines[0]
    assert "types entry 'Linaer' matches no module" in lines[1] and "Linear" in lines[1]
    assert lines[2] == lines[0]


def test_the_magic_takes_a_quoted_pattern_without_its_quotes(ip) -> None:
    """IPython's splitter keeps the quotes of ``--include 'encoder.*'``: the pattern matched no module."""
    ip.user_ns["model"] = Net()
    ip.user_ns["torch"] = torch
    with warnings.catch_warnings(record=True) as caught, capture_output():
        warnings.simplefilter("always")
        ip.run_cell("%%nantrace model --include 'encoder.*' --exclude \"head\"\nran = model(torch.randn(2, 4))")
    assert _messages(caught) == []
    from nan_magic.ipython.magics import NanMagics

    magics = ip.magics_manager.registry[NanMagics.__name__]
    args = magics._parse(magics.nantrace, "model --include 'encoder.*' --exclude \"head\" --log-file 'a b.jsonl'", "x")
    assert (args.include, args.exclude, args.log_file, args.targets) == (
        ["encoder.*"],
        ["head"],
        "a b.jsonl",
        ["model"],
    )


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


@pytest.mark.parametrize("options", [{}, {"defer": True}, {"mode": "full"}, {"ops": True}], ids=str)
def test_a_failing_step_says_each_unmatched_filter_once(options: dict) -> None:
    """Round 20: where the event was localized by replaying the step, the replay's own watch said it again (a user
    saw the same line twice in the cell, the second one from the replay)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), _Log(), nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(nan_magic.NonFiniteError) as raised:
        warnings.simplefilter("always")
        with nan_magic.watch(model, opt, types=["Linaer"], include=["encodr.*"], **options):
            for _ in range(3):
                loss = model(torch.randn(8, 2)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert raised.value.report.op == "aten.log.default"
    lines = _messages(caught)
    assert len(lines) == 2, lines
    assert "include pattern 'encodr.*'" in lines[0] and "types entry 'Linaer'" in lines[1]
