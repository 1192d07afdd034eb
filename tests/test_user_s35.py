"""Session 35's walk, in-process: what its notebooks (tests/notebooks/user_s35/) showed wrong, each as a test.

A price regressor cast to float16 with ``.half()`` (its squared error overflows 65504): the float32 fix was verified,
but the edit it suggested read ``price[i:i.float() + 64].float().half()``: ``.float()`` on the slice's Python int
(an AttributeError when pasted). The line's own ``.half()`` casts stay as the trial ran them (the subtraction promotes
to float32; a cast of the line's result may feed a half layer on the next line). A siamese network calls its one
encoder twice a step, on the two photos of each pair, and one loss takes both: its report said "the step's 2nd
model call: with gradient accumulation, its 2nd micro-batch" and "the step's other micro-batches were not replayed",
of a loop that accumulates nothing. A hand-written batch norm's
``x.var(0)`` on the epoch's last batch of one row: torch's "degrees of freedom is <= 0" warning stood three times above
the error, once from the user's step and once from each replay of it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic
from nan_magic.render.edits import suggested_edit

LINE = "loss = ((pred - price[i:i + 64].half()) ** 2).sum()"


def _half_price() -> nan_magic.Report:
    torch.manual_seed(0)
    X = torch.randn(256, 8)
    price = 300.0 + 40.0 * X[:, :1]
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        for i in range(0, 256, 64):
            pred = model(X[i:i + 64].half())
            loss = ((pred - price[i:i + 64].half()) ** 2).sum()
            opt.zero_grad(); loss.backward(); opt.step()  # noqa: E702
    return caught.value.report


def test_the_float32_edit_of_a_half_cast_line_upcasts_the_tensors_not_the_slice() -> None:
    report = _half_price()
    assert report.op == "aten.pow.Tensor_Scalar" and report.step == 0 and report.source.line.strip() == LINE
    (trial,) = [trial for trial in report.fixes if trial.kind == "float32"]
    assert trial.finite
    edit = suggested_edit(trial)
    # Was "loss = ((pred.float() - price[i:i.float() + 64].float().half()) ** 2).sum()"
    assert edit is not None and edit.endswith(
        ": loss = ((pred.float() - price[i:i + 64].float().half()) ** 2).sum()"), edit
    # pasted, it runs and computes in float32: finite where the user's line overflowed
    code = edit.split(": ", 1)[1]
    scope = {"pred": torch.full((64, 1), 0.5, dtype=torch.float16), "price": torch.full((256, 1), 400.0), "i": 64}
    exec(code, {}, scope)
    assert scope["loss"].dtype == torch.float32 and torch.isfinite(scope["loss"])


def _siamese() -> nan_magic.Report:
    torch.manual_seed(0)
    imgs = torch.randn(64, 1, 8, 8)
    imgs[41] = imgs[17]  # the same photo uploaded twice, paired with its copy as "different"
    pairs = torch.stack([torch.arange(64), torch.randperm(64)], 1)
    pairs[45] = torch.tensor([17, 41])
    same = (torch.rand(64) < 0.5).float()
    same[45] = 0.0
    emb = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 16))
    opt = torch.optim.SGD(emb.parameters(), lr=0.05)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(emb, opt):
        for i in range(0, 64, 16):
            p = pairs[i:i + 16]
            a, b = emb(imgs[p[:, 0]]), emb(imgs[p[:, 1]])
            d = ((a - b) ** 2).sum(1).sqrt()
            loss = (same[i:i + 16] * d ** 2 + (1 - same[i:i + 16]) * F.relu(1.0 - d) ** 2).mean()
            opt.zero_grad(); loss.backward(); opt.step()  # noqa: E702
    return caught.value.report


def test_a_siamese_pairs_second_encoder_call_is_not_called_a_micro_batch_of_gradient_accumulation() -> None:
    report = _siamese()
    assert (report.phase.value, report.step, report.model_call) == ("backward", 2, 2)
    text = report.to_text()
    assert "step        2 (the step's 2nd model call)\n" in text, text
    assert "Fixes tried on a replay of step 2's 2nd model call alone (the step's other model calls were not " \
        "replayed; on copies" in text
    assert "micro-batch" not in text and "accumulation" not in text


def test_torchs_warning_in_the_users_step_is_said_once_not_again_by_each_replay() -> None:
    torch.manual_seed(0)
    X = torch.randn(97, 4)  # batches of 32, 32, 32 and 1
    y = (X[:, 0] > 0).long()

    class MyBatchNorm(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x - x.mean(0)) / torch.sqrt(x.var(0) + 1e-5)

    net = nn.Sequential(nn.Linear(4, 16), MyBatchNorm(), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("default")  # Python's own for a UserWarning: once per place
        with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(net, opt):
            for i in range(0, 97, 32):
                loss = F.cross_entropy(net(X[i:i + 32]), y[i:i + 32])
                opt.zero_grad(); loss.backward(); opt.step()  # noqa: E702
    report = caught.value.report
    assert (report.module, report.op, report.step) == ("1", "aten.var.correction", 3)
    assert [trial.finite for trial in report.fixes] == [True]  # (the replays ran: the fix was tried)
    said = [str(w.message) for w in heard if "degrees of freedom" in str(w.message)]
    assert len(said) == 1, said  # was 3: the step's own, then the localizing replay's and the fix trial's


def test_the_float32_edit_keeps_a_cast_of_the_lines_result_that_a_half_layer_reads_next() -> None:
    """``sq = ((pred - p.half()) ** 2 / 1000).half()`` then a float16 ``head(sq)``: the trial kept the cast; an edit
    that dropped it (review of user-s35) made the pasted next line raise 'mat1 and mat2 must have the same dtype'."""
    torch.manual_seed(0)
    X = torch.randn(256, 8)
    price = 300.0 + 40.0 * X[:, :1]
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    head = nn.Linear(1, 1).half()
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=1e-4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        for i in range(0, 256, 64):
            pred = model(X[i:i + 64].half())
            sq = ((pred - price[i:i + 64].half()) ** 2 / 1000).half()
            loss = head(sq).sum()
            opt.zero_grad(); loss.backward(); opt.step()  # noqa: E702
    (trial,) = [trial for trial in caught.value.report.fixes if trial.kind == "float32"]
    edit = suggested_edit(trial) if trial.finite else None
    assert edit is not None and edit.endswith(
        ": sq = ((pred.float() - price[i:i + 64].float().half()) ** 2 / 1000).half()"), edit
    scope = {"pred": torch.full((64, 1), 0.5, dtype=torch.float16), "price": torch.full((256, 1), 400.0), "i": 64}
    exec(edit.split(": ", 1)[1], {}, scope)
    assert scope["sq"].dtype == torch.float16 and head(scope["sq"]).dtype == torch.float16


def test_the_full_watchs_replay_of_the_producing_call_does_not_say_the_users_warning_again() -> None:
    """mode="full" replays the producing call from the check itself (localize/producer.py), outside the event's
    replays: under an "always" filter the user's own warning was said 5 times where the unwatched run says it 4."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.bad = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            warnings.warn("check the input scale", UserWarning, stacklevel=2)
            return h.log() if self.bad else h

    torch.manual_seed(0)
    model, X = Scaled(), torch.randn(6, 8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, mode="full"):
            for step in range(6):
                model.bad = step == 3
                loss = model(X[step]).sum()
                opt.zero_grad(); loss.backward(); opt.step()  # noqa: E702
    assert (caught.value.report.op, caught.value.report.step) == ("aten.log.default", 3)
    assert sum("check the input scale" in str(w.message) for w in heard) == 4  # steps 0-3, as unwatched
