"""What a user running plain scripts, CI and pytest saw go wrong (session 24's walk), each as a test.

The walk's scripts are in tests/scripts/user24/: a training loop across two modules (trainlib.py) with a NaN in
the forward, the loss code, the backward, the optimizer step or the data, run with ``python train.py`` and
``python -m nan_magic run``, in every ``on_detect`` mode, with ``defer=True``, under ``PYTHONWARNINGS=error``,
piped to files; a scene opened by a colleague (colleague.py); a pytest suite using the plugin (suite.py).
Each defect found there has its test here, in process where the defect allows.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.cli import main

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts" / "user24"


class LogHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.proj(x))  # negative inputs: NaN


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), LogHead())


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_warn_mode_under_warnings_as_errors_stops_with_the_report(where: str) -> None:
    """``PYTHONWARNINGS=error`` (pytest's ``filterwarnings = error``) with ``on_detect="warn"``: the warning became a
    bare RuntimeWarning raised from inside the watch's hook, a traceback through a dozen of nan_magic's frames and no
    report. The user asked for the warning to be an error: the run stops as ``raise`` stops it, with the report."""
    model = _model() if where == "forward" else nn.Linear(4, 4)
    x = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, on_detect="warn") as w:
            out = model(x)
            if where == "backward":
                (out - out).pow(2).sum().sqrt().backward()  # sqrt's derivative at 0 is inf, times 0: NaN
    report = caught.value.report
    assert report is not None and w.report is not None and report.phase == where
    if where == "forward":
        assert (report.module, report.op) == ("1", "aten.log.default")
    # The traceback ends in the user's code (this test), as raise mode's does: no hook frame of ours last.
    last = caught.tb
    while last.tb_next is not None:
        last = last.tb_next
    assert "nan_magic" not in Path(last.tb_frame.f_code.co_filename).parts


def test_warn_mode_still_warns_and_goes_on_without_an_error_filter() -> None:
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nan_magic.watch(model, on_detect="warn") as w:
            model(torch.randn(8, 4))
            model(torch.randn(8, 4))  # the run goes on after the first event
    assert [str(warning.message).split(":")[0] for warning in caught] == [
        "first non-finite value in forward step 0", "non-finite value in forward step 1"]
    assert w.report is not None and w.report.module == "1"


def test_an_unmatched_filter_warning_made_an_error_does_not_replace_the_event() -> None:
    """``-W error`` and a misspelled ``types`` in ``python -m nan_magic run``: the watch's exit warned of the filter
    while the NonFiniteError propagated, and the warning, raised, replaced it: "During handling of the above
    exception, another exception occurred", a NanMagicWarning from filters.py. The event is raised; the warning
    is a note on it."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(types=["Nope"]):
            model(torch.randn(8, 4))
    assert caught.value.report.op == "aten.log.default"
    if sys.version_info >= (3, 11):
        assert any("types entry 'Nope' matches no module" in note for note in caught.value.__notes__)


def test_an_unmatched_filter_warning_made_an_error_is_raised_where_nothing_else_is() -> None:
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(nan_magic.NanMagicWarning, match="types entry 'Nope'"), nan_magic.watch(types=["Nope"]):
            model[0](torch.randn(8, 4))


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scene whose report holds symbols outside ASCII (the sqrt-domain cause's ``1/(2·sqrt(x))``, the bars)."""
    folder = tmp_path_factory.mktemp("scene")
    model = nn.Linear(4, 4)
    with pytest.raises(nan_magic.NonFiniteError), nan_magic.watch(model, dump=str(folder)):
        out = model(torch.randn(8, 4))
        (out - out).pow(2).sum(-1).sqrt().mean().backward()
    (path,) = folder.glob("*.pt")
    return path


def test_show_on_an_ascii_stdout_writes_the_report_in_ascii(scene: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m nan_magic show`` on a CI runner whose stdout is ASCII (``PYTHONIOENCODING=ascii``, a C locale
    before Python's coercion, a Windows code page) died of a UnicodeEncodeError in cli.py, exit 1, as for an event;
    ``run`` wrote ``\\u2581`` escapes for the histogram bars on stderr."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["show", str(scene)]) == 0
    out.flush()
    text = out.buffer.getvalue().decode("ascii")
    assert "first non-finite" in text and "Histograms of the producer's values" in text
    assert "1/(2*sqrt(x))" in text and "\\u" not in text


def test_show_on_a_utf8_stdout_keeps_the_symbols(scene: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["show", str(scene)]) == 0
    out.flush()
    assert "1/(2\u00b7sqrt(x))" in out.buffer.getvalue().decode("utf-8")


def test_version_for_a_ci_log(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m nan_magic --version`` was refused ("the following arguments are required: COMMAND")."""
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"nan_magic {nan_magic.__version__} (torch {torch.__version__})"


def test_a_plugin_suite_under_warnings_as_errors_fails_each_bad_test_with_its_report() -> None:
    """The walk's CI suite (scripts/user24/suite.py: the fixture and the marker, raise, warn and log, defer) run by
    pytest with ``-W error``: its warn-mode test failed with a RuntimeWarning raised in our hook, not the report."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(SCRIPTS)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "nan_magic.pytest_plugin",
         "-W", "error", "suite.py"],
        cwd=SCRIPTS, env=environment, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "5 failed, 2 passed" in done.stdout
    # Each failure's section: its header, then the report's headline (pytest.fail with the report, no traceback).
    failures = dict(re.findall(r"^_{3,} (\S+) _{3,}\n(.*)$", done.stdout, re.MULTILINE))
    assert sorted(failures) == ["test_bad_data_marker_warn", "test_bad_forward_marker",
                                "test_bad_with_fixture[backward]", "test_bad_with_fixture[loss]",
                                "test_bad_with_fixture[optimizer]"]
    assert all(text.startswith("nan_magic: first non-finite") for text in failures.values()), failures
    assert "RuntimeWarning" not in done.stdout


INTERRUPTED = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(4):
    out = model(torch.randn(8, 4))
    loss = (out.log() if {bad} else out.pow(2)).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 2:
        raise KeyboardInterrupt  # Ctrl-C, pressed at the third step of a long run
"""


@pytest.mark.parametrize("bad", [True, False])
def test_ctrl_c_on_a_log_run_keeps_the_event_found_before_it(
    bad: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m nan_magic run --log --json r.json train.py``, a long run whose loss went NaN at step 0, stopped with
    Ctrl-C: the interrupt left through cli.py and runpy (their frames and our hook's in the traceback), with no report,
    no JSON and the status of a signal. The report and the JSON are written and the status is 1; a run with no
    event before the interrupt gives 130, as a shell does, and the traceback shows none of our frames."""
    script = tmp_path / "train.py"
    script.write_text(INTERRUPTED.format(bad=bad))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    status = main(["run", "--log", "--json", str(tmp_path / "r.json"), str(script)])
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n") and "\nKeyboardInterrupt\n" in err
    assert "nan_magic" not in err.split("\nKeyboardInterrupt\n")[0] and "runpy" not in err
    if bad:
        assert status == 1 and (tmp_path / "r.json").exists()
        assert "nan_magic: first non-finite value in forward step 0" in err
    else:
        assert status == 130 and not (tmp_path / "r.json").exists()
        assert "nan_magic: no real non-finite event (0 benign) in 3 step(s)" in err


def test_a_misspelled_types_in_run_warns_in_a_readable_line(tmp_path: Path) -> None:
    """``python -m nan_magic run --types Linaer train.py``: judged as the run ends, where no line of the script is the
    warning's place, it printed as ``nan_magic:0: NanMagicWarning: nan_magic: types entry ...`` in the CI log."""
    script = tmp_path / "train.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(4, 4)\nmodel(torch.randn(2, 4))\n")
    done = subprocess.run(
        [sys.executable, "-m", "nan_magic", "run", "--types", "Linaer", str(script)],
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("NanMagicWarning: nan_magic: types entry 'Linaer' matches no module"), done.stderr


OWN_WATCH = """
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
def test_run_over_a_script_with_its_own_watch_does_not_say_clean(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m nan_magic run train.py`` where train.py enters ``nan_magic.watch`` itself: the script's watch took
    over the model's hooks, raised (or logged) the NaN, and the CLI's watch printed "no real non-finite event" and
    exited 0: a CI gate passing a NaN run. The nested watch's events are now the outer's: the report, status 1."""
    script = tmp_path / "train.py"
    script.write_text(OWN_WATCH)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["run", str(script), mode]) == 1
    err = capsys.readouterr().err
    assert "no real non-finite event" not in err
    assert re.search(r"^nan_magic: first non-finite value in forward step 0: code outside any watched module, op "
                     r"aten\.log\.default at \S*train\.py:11 ", err, re.MULTILINE), err


@pytest.mark.parametrize("outer_targets", ["model", "none"])
def test_a_nested_watchs_log_mode_event_is_the_outer_watchs_report(outer_targets: str) -> None:
    """The same through the API (the pytest marker's watch around code that watches in ``log`` mode): the outer
    watch's ``report`` and ``events`` hold what the nested one found, and nothing is raised."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with nan_magic.watch(*([model] if outer_targets == "model" else [])) as outer:
        model(torch.randn(8, 4)).pow(2).mean().backward()
        with nan_magic.watch(model, on_detect="log") as inner:
            model(torch.randn(8, 4)).log().mean().backward()
        assert inner.report is not None
        assert outer.report is inner.report and outer.events[-len(inner.events):] == inner.events
    assert outer.report is inner.report


def test_an_early_warning_in_warn_mode_is_placed_at_the_users_line() -> None:
    """A loss spike in ``on_detect="warn"``: printed as
    ``nan_magic/hot/checks/optimizer/step_checks.py:315: NanMagicWarning: the loss reached ...`` with our source line
    under it, where the events' warnings name the user's line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught, nan_magic.watch(model, opt, on_detect="warn"):
        warnings.simplefilter("always")
        for step in range(12):
            loss = model(torch.randn(8, 4) * (1e4 if step == 10 else 1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    early = [warning for warning in caught if issubclass(warning.category, nan_magic.NanMagicWarning)]
    assert any("the loss reached" in str(warning.message) for warning in early)
    assert {warning.filename for warning in early} == {__file__}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11+")
def test_a_plugin_test_failing_of_its_own_after_a_logged_event_shows_the_report() -> None:
    """``@pytest.mark.nan_watch(on_detect="log")`` over a test whose own ``assert torch.isfinite(loss)`` then fails:
    pytest showed ``AssertionError`` alone, nothing of where the NaN was born. The report is now a note under it."""
    from nan_magic.pytest_plugin import watching

    model = _model()
    with pytest.raises(AssertionError) as caught, watching(model, on_detect="log"):
        out = model(torch.randn(8, 4))
        assert torch.isfinite(out).all()
    (note,) = caught.value.__notes__
    assert note.startswith("nan_magic: first non-finite value in forward step 0: 1 (LogHead), op aten.log.default")


def test_the_loss_backwards_nodes_are_listed_with_their_counts() -> None:
    """The backward producer's note said "ran 9 autograd nodes (AddBackward0, MeanBackward0, SqrtBackward0,
    PowBackward0, SumBackward1, SubBackward0)": six names for nine nodes."""
    from nan_magic.render.words.note_words import note_text

    nodes = ("AddBackward0", "MeanBackward0", "SqrtBackward0", "MeanBackward0", "PowBackward0", "PowBackward0")
    text = note_text(nan_magic.Note.of("loss-region", nodes=nodes, singular=("SqrtBackward0",)))
    assert text == ("the backward of that code ran 6 autograd nodes (AddBackward0, MeanBackward0 x2, SqrtBackward0, "
                    "PowBackward0 x2); the ones whose derivative can be infinite: SqrtBackward0")


def test_run_makes_the_folders_of_its_json_and_html(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json out/report.json`` in a fresh CI workspace: "could not write out/report.json: FileNotFoundError", and
    the HTML of ``--dump DIR`` where the event was a script's own watch's (no scene made DIR) likewise."""
    script = tmp_path / "train.py"
    script.write_text(OWN_WATCH)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--json", "out/report.json", "--dump", "scenes", str(script), "log"]) == 1
    err = capsys.readouterr().err
    assert "could not write" not in err
    assert (tmp_path / "out" / "report.json").exists() and (tmp_path / "scenes" / "nan_report.html").exists()


def test_an_unmatched_include_on_a_one_module_model_says_what_exists() -> None:
    """``watch(nn.Linear(4, 4), include="fc*")`` warned "... (their module names: )": the root's name is empty."""
    model = nn.Linear(4, 4)
    with pytest.warns(nan_magic.NanMagicWarning) as caught, nan_magic.watch(model, include="fc*"):
        model(torch.randn(2, 4))
    (message,) = [str(warning.message) for warning in caught]
    assert message.endswith("(their module names: none but the root)")
