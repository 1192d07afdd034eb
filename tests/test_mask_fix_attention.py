"""The ``mask`` fix trial for an ``nn.MultiheadAttention`` whose key padding mask hides a whole row.

Its softmax runs inside torch's ``multi_head_attention_forward``, which a function mode sees whole: the trial
had "found nothing to change at the producer's line". It now replays the step with the call made with
``need_weights=False`` (torch's fused attention gives a fully masked row 0 and a finite gradient); a model that
reads the weights gets None there, and the trial says what the replay raised instead of claiming a fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic.errors.exceptions import NonFiniteError


class Block(nn.Module):
    def __init__(self, reads_weights: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 20)
        self.reads_weights = reads_weights

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        a, weights = self.attn(h, h, h, key_padding_mask=padding)  # a fully padded row: NaN in the weights' softmax
        if self.reads_weights:
            a = a + weights.mean(-1, keepdim=True)
        return self.head(a)


def _mask_trial(reads_weights: bool, defer: bool) -> tuple[nan_magic.Report, str]:
    torch.manual_seed(0)
    model = Block(reads_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 20, (4, 10))
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        for step in range(3):
            padding = torch.zeros(4, 10, dtype=torch.bool)
            padding[:, 8:] = True
            if step == 2:
                padding[1] = True  # row 1 of the batch is all padding
            loss = F.cross_entropy(model(tokens, padding).flatten(0, 1), tokens.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.module, report.op, report.step) == ("attn", "aten._softmax.default", 2)
    assert report.cause is not None and report.cause.label == "masked-softmax"
    (trial,) = [trial for trial in report.fixes if trial.kind == "mask"]
    return trial, report.to_text()


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
def test_the_attention_module_without_its_weights_is_verified_finite(defer: bool) -> None:
    trial, text = _mask_trial(reads_weights=False, defer=defer)
    assert trial.finite is True and trial.fact("weights_off") is True
    assert "mask: nn.MultiheadAttention called with need_weights=False" in text, text
    assert "found nothing to change" not in text


def test_a_model_that_reads_the_weights_is_told_what_the_replay_raised() -> None:
    trial, text = _mask_trial(reads_weights=True, defer=False)
    assert trial.finite is False and trial.failed == "raised", trial
    assert trial.error is not None and "NoneType" in trial.error[1], trial.error
    assert "-> the replay raised" in text and "verified" not in text.split("mask: ")[1].split("\n")[0], text
