"""ops=True without the fix trials keeps no model call to replay: %debug stays where the step was judged, and the
report says why (gaps20). The contract rows of this round are in tests/contract/gaps20.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic


class Sqrt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).abs().sqrt().sum(-1, keepdim=True)


def _backward_event(**options: object) -> nan_magic.Report:
    """sqrt at zero (the weights zeroed at step 1): a backward producer named at its forward line."""
    torch.manual_seed(0)
    model = Sqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    model.lin.weight.zero_()
                    model.lin.bias.zero_()
            loss = ((model(torch.randn(8, 4)) - torch.rand(8, 1)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return caught.value.report


def test_ops_without_fix_trials_says_why_debug_is_not_at_the_forward_line() -> None:
    report = _backward_event(ops=True, fixes=False)
    assert (str(report.phase), report.op) == ("backward", "aten.div.Tensor")
    assert report.debug_frame is not None and report.debug_frame.function == "_backward_event"
    said = [note for note in report.note_facts if note.kind == "debug-not-replayed"]
    assert len(said) == 1 and dict(said[0].facts)["reason"] == ("ops-keeps-no-call", ()), report.note_facts
    assert any("fixes=False" in sentence for sentence in report.notes), report.notes


@pytest.mark.parametrize("options", [{"ops": True}, {}, {"mode": "full"}], ids=["ops", "default", "full"])
def test_a_watch_that_replays_the_line_says_nothing_of_it(options: dict[str, object]) -> None:
    """The note is the unkept watch's alone: a step replay's nested ops watch keeps no calls either, says nothing."""
    report = _backward_event(**options)
    assert report.debug_frame is not None and report.debug_frame.function == "forward"
    assert [note.kind for note in report.note_facts].count("debug-in-replay") == 1, report.note_facts
    assert not any(note.kind == "debug-not-replayed" for note in report.note_facts), report.note_facts
