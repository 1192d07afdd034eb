"""Known wrong answers a script user saw (session 24's closing note), each as a test that failed before its fix."""

from __future__ import annotations

import linecache
import os
import re
import subprocess
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn

import nan_magic

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "default": {},
    "defer": {"defer": True},
    "full": {"mode": "full"},
    "ops": {"ops": True},
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def _write_a_nan_at_step_2(**options: object) -> nan_magic.Watch:
    """A training loop that writes a NaN into step 2's batch on the line before the model call, under a watch."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nan_magic.watch(model, opt, **options) as w:
        for step in range(4):
            x, y = torch.randn(16, 4), torch.randn(16, 4)
            if step == 2:
                x[3, 2] = float("nan")
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_the_loop_writes_into_the_batch_is_named_at_its_line(mode: str) -> None:
    """``x[3, 2] = float("nan")`` on the line before the model call was reported as data at the model's input, op and
    line None: torch lifts the number into a tensor (``aten.lift_fresh``) and copies it in, both passive ops, and the
    lifted NaN came from outside the recorded ops. The op tracer now keeps the memory a lifted non-finite number was
    written into, and a batch's claim (phase data) names that lift and its line, in every mode (ops=True since
    gaps26); its consumers still read it as a value from outside (a NaN label the loss reads stays data at the line
    that read it)."""
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _write_a_nan_at_step_2(**MODES[mode])
    report = caught.value.report
    assert (report.phase, report.step, report.nan) == ("data", 2, 1)
    assert report.source is not None and report.source.line == 'x[3, 2] = float("nan")'
    assert Path(report.source.filename) == Path(__file__)
    assert report.op == "aten.lift_fresh.default"
    assert report.cause is not None and report.cause.label == "bad-input-data"  # (a batch holding it, as loaded)


@pytest.mark.parametrize("mode", MODES)
def test_finite_and_infinite_literals_stay_calm(mode: str) -> None:
    """The literal rule reads only what a loop writes: a finite literal, and an infinity written as a mask value
    (deliberate, as ``masked_fill(mask, -inf)`` is), raise nothing and leave the model as an unwatched run does."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = self.fc(x)
            mask = torch.zeros_like(scores)
            mask[:, 0] = float("-inf")
            return torch.softmax(scores + mask, -1)

    def run(watched: bool) -> list[float]:
        torch.manual_seed(0)
        model = Masked()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        losses = []
        with nan_magic.watch(model, opt, **MODES[mode]) if watched else nullcontext() as w:
            for _ in range(3):
                x = torch.randn(8, 4)
                x[0, 0] = 0.5
                loss = (model(x) - torch.tensor([0.25, 0.25, 0.25, 0.25])).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        if watched:
            assert w.report is None and not w.events
        return losses

    assert run(True) == run(False)


UNCAUGHT = """\
import torch
from torch import nn

import nan_magic

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
with nan_magic.watch(model):
    out = model(torch.randn(8, 4))
    loss = torch.log(out).mean()
    loss.backward()
"""


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "dumb", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11+")
def test_an_uncaught_error_in_a_script_shows_the_compact_report_once(tmp_path: Path) -> None:
    """``python train.py`` that does not catch NonFiniteError showed the one-line headline alone: the module, op,
    line and cause were in ``error.report`` where no one printed it. The compact report is a note under the error
    (the cause, the fixes, the producer's facts, where pdb.pm() opens); ``python -m nan_magic run`` prints the
    whole report after the traceback, so the note is not there too."""
    script = tmp_path / "train.py"
    script.write_text(UNCAUGHT)
    plain = _python(str(script), cwd=tmp_path)
    assert plain.returncode == 1
    err = plain.stderr
    headline = err.index("NonFiniteError: first non-finite value in forward step 0")
    assert err.index("Likely cause: log-domain") > headline and err.count("Likely cause") == 1
    assert re.search(r"^  op +torch\.log\(out\)  \(aten\.log\.default\)$", err, re.MULTILINE), err
    assert re.search(r"^  line +loss = torch\.log\(out\)\.mean\(\)$", err, re.MULTILINE), err
    assert "pdb.pm() opens in" in err and "Histograms" not in err
    run = _python("-m", "nan_magic", "run", str(script), cwd=tmp_path)
    assert run.returncode == 1 and run.stderr.count("Likely cause: log-domain") == 1, run.stderr
    assert "Histograms" in run.stderr  # (the whole report, once)


def test_a_caught_error_keeps_its_note_out_of_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """The note is under the error, not in it: ``str(error)`` is still the one-line headline, and the note is
    added once where the error leaves two watches (a script's own watch inside ``run``'s, the pytest marker's)."""
    from nan_magic.errors import exceptions

    monkeypatch.setattr(exceptions, "running_shell", lambda: None)  # (a script: no IPython shell in this process)
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model), nan_magic.watch(model):
        model(torch.randn(8, 4)).log().mean().backward()
    error = caught.value
    assert "\n" not in str(error) and str(error) == error.report.message
    if sys.version_info >= (3, 11):
        assert error.__notes__ == [error.report.to_text(compact=True)]
        assert "Likely cause: log-domain" in error.__notes__[0]


class _LogHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(self.proj(h))  # negative inputs: NaN, then NaN gradients into every parameter


def _poisoned_run(on_detect: str, steps: int = 6) -> tuple[nan_magic.Watch, list[warnings.WarningMessage]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _LogHead())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught, nan_magic.watch(model, opt, on_detect=on_detect) as w:
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = (model(torch.randn(16, 4)) - torch.randn(16, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w, caught


def test_warn_mode_warns_once_per_new_event_and_counts_the_rest_at_the_end() -> None:
    """After the first event the NaN sits in the parameters, and every later step met it three times (the parameter
    in the forward, the loss, the optimizer's step): three warnings a step, a flood in a long run. An event no op made
    is warned of once for what it names; the repeats are counted in one warning as the watch is left. The events
    themselves are all kept, as log mode keeps them."""
    w, caught = _poisoned_run("warn")
    events = [warning for warning in caught if warning.category is RuntimeWarning]
    counts = [warning for warning in caught if issubclass(warning.category, nan_magic.NanMagicWarning)]
    assert str(events[0].message).startswith("first non-finite value in forward step 0: 2 (_LogHead)")
    assert len(events) == len({(e.phase, e.module, e.tensor, e.source) for e in w.events}) <= 4
    (count,) = counts
    assert str(count.message).startswith(f"{len(w.events) - len(events)} more non-finite events in steps 1 to 5 ")
    assert count.filename == __file__
    logged, quiet = _poisoned_run("log")
    assert [e.message for e in logged.events] == [e.message for e in w.events] and len(w.events) >= 15
    assert not [warning for warning in quiet if issubclass(warning.category, RuntimeWarning)]


def test_raise_mode_still_stops_at_the_first_event() -> None:
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _poisoned_run("raise")
    assert caught.value.report.module == "2" and caught.value.report.op == "aten.log.default"


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_a_later_check_meeting_the_written_batch_again_is_no_second_event(mode: str) -> None:
    """log mode: once the first event named the line that wrote the batch, a later check of the same step that meets
    the batch without the data region's records (the optimizer's) is the same event, not a second one."""
    w = _write_a_nan_at_step_2(on_detect="log", **MODES[mode])
    data = [event for event in w.events if event.phase == "data"]
    assert len(data) == 1 and data[0].op == "aten.lift_fresh.default"


def test_an_early_warning_made_an_error_is_raised_at_the_users_line() -> None:
    """``python -W error`` (pytest's ``filterwarnings = error``) in warn mode: a loss spike's NanMagicWarning was raised
    from our optimizer hook, the traceback ending in hot/step_cycle.py's ``warnings.warn`` through torch's wrapper.
    It now ends at the user's line the warning names (``opt.step()``), as an unwatched error's would."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(nan_magic.NanMagicWarning, match="the loss reached") as caught, nan_magic.watch(
                model, opt, on_detect="warn"):
            for step in range(12):
                loss = model(torch.randn(8, 4) * (1e4 if step == 10 else 1)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    last = caught.tb
    while last.tb_next is not None:
        last = last.tb_next
    assert Path(last.tb_frame.f_code.co_filename) == Path(__file__)
    assert "opt.step()" in linecache.getline(__file__, last.tb_lineno)


OWN_WATCH = """\
import sys
import torch
from torch import nn
import nan_magic

torch.manual_seed(0)
model = nn.Linear(4, 4)
with nan_magic.watch(model, on_detect=sys.argv[1]) as w:
    for step in range(3):
        model(torch.randn(8, 4)).log().mean().backward()
print("own watch:", w.report.op)
"""


@pytest.mark.parametrize("mode", ["raise", "log"])
def test_run_dump_saves_the_scene_of_the_scripts_own_watchs_event(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m nan_magic run --dump DIR train.py`` where train.py enters its own watch: the event is the outer
    watch's (session 24), but the scene was saved by neither: the script's watch has no ``dump``, and the outer one
    had stood aside for the whole step. The script's watch saves it to the outer's folder, and the scene opens."""
    from nan_magic.cli import main

    script = tmp_path / "train.py"
    script.write_text(OWN_WATCH)
    folder = tmp_path / "scenes"
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["run", "--dump", str(folder), str(script), mode]) == 1
    err = capsys.readouterr().err
    (scene,) = folder.glob("nan_scene_*.pt")
    assert "scene saved: " in err, err
    loaded = nan_magic.load_scene(str(scene))
    assert loaded.report.op == "aten.log.default"


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_a_soft_prompt_gets_no_skip_batch_and_a_bad_batch_still_does(mode: str) -> None:
    """A soft prompt (a free tensor the loop steps by hand, passed to the model) made NaN by its own update got a
    verified "skip-batch": the step without prompt slot 3, as if the prompt's rows were samples. Its rows are slots of
    a tensor the loop trains: skipping them means nothing for where the NaN came from, and it is not offered. A
    batch the loop wrote a NaN into (rows that are samples) still gets it, verified."""
    from contract.hunt24 import _soft_prompt

    scenario = _soft_prompt(0.0)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **MODES[mode]):
        scenario.run()
    report = caught.value.report
    assert (report.phase, report.op, report.cause.label) == ("data", "aten.div.Tensor", "division-by-zero")
    assert "skip-batch" not in [fix.kind for fix in report.fixes]
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _write_a_nan_at_step_2(**MODES[mode])
    assert [(fix.kind, fix.finite) for fix in caught.value.report.fixes] == [("skip-batch", True)]
