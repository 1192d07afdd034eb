"""``python -m nan_magic run``: exit status and outputs, through a real subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nan_magic
from nan_magic.cli import main

SCRIPT = '''
import sys
import torch
from torch import nn


class Norm(nn.Module):
    def forward(self, x):
        centred = x - x.mean(-1, keepdim=True)
        return centred / centred.pow(2).mean(-1, keepdim=True).sqrt()


class Root(nn.Module):
    def forward(self, x):
        return torch.sqrt(x.abs() + 1e-30)  # a huge derivative where x is 0


mode = sys.argv[1]
print("argv", sys.argv[1:])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), Root() if mode == "amp" else Norm(), nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**88)
if mode == "amp":
    # one output of the first layer is exactly 0: the scaled gradients overflow
    # at the first steps, the GradScaler skips them and lowers its scale
    with torch.no_grad():
        model[0].weight[0].zero_()
        model[0].bias[0] = 0.0
for step in range(4):
    if mode in ("fail", "warn") and step == 2:
        with torch.no_grad():
            model[0].weight.zero_()
            model[0].bias.zero_()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    if mode == "amp":
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
if mode == "raise":
    raise ValueError("the script's own failure")
if mode == "exit":
    sys.exit(4)
print("done")
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("scripts") / "train.py"
    path.write_text(SCRIPT)
    return path


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nan_magic", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_a_real_event_exits_1_with_the_report_the_scene_and_html_and_json(script, tmp_path) -> None:
    done = run("run", "--dump", "scenes", "--json", "report.json", str(script), "fail", "--lr", "3", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "argv ['fail', '--lr', '3']" in done.stdout  # the script's own arguments and stdout
    assert "done" not in done.stdout  # stopped at the event
    # the traceback starts in the script, not in runpy or nan_magic
    assert done.stderr.startswith("Traceback (most recent call last):\n  File \"" + str(script))
    assert "nan_magic: first non-finite value in forward step 2: 1 (Norm), op aten.div.Tensor" in done.stderr
    assert "scene saved: scenes/nan_scene_step2.pt" in done.stderr
    assert sorted(path.name for path in (tmp_path / "scenes").iterdir()) == ["nan_report.html", "nan_scene_step2.pt"]
    assert "nan-magic-report" in (tmp_path / "scenes" / "nan_report.html").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["module"] == "1"
    scene = nan_magic.load_scene(tmp_path / "scenes" / "nan_scene_step2.pt")
    assert scene.module == "1" and scene.batch["input[0]"].shape == (8, 4)
    assert [entry["type"] for entry in scene.data["optimizers"]] == ["SGD"]  # adopted from the script
    assert list(scene.data["models"]) == ["model"]  # its variable's name in the script, as a notebook's scene says


def test_a_healthy_script_exits_0(script, tmp_path) -> None:
    done = run("run", str(script), "healthy", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout
    assert "nan_magic: no real non-finite event (0 benign) in 4 step(s)" in done.stderr


def test_steps_a_grad_scaler_skips_are_benign(script, tmp_path) -> None:
    done = run("run", str(script), "amp", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    benign = re.search(r"no real non-finite event \((\d+) benign\)", done.stderr)
    assert benign is not None and int(benign[1]) >= 1, done.stderr


def test_warn_mode_runs_the_script_to_the_end_and_still_fails(script, tmp_path) -> None:
    done = run("run", "--warn", str(script), "warn", cwd=tmp_path)
    assert done.returncode == 1
    assert "done" in done.stdout
    assert "nan_magic: first non-finite value in forward step 2" in done.stderr


@pytest.mark.parametrize(
    ("mode", "status", "shown"),
    [("raise", 3, "ValueError: the script's own failure"), ("exit", 4, "no real non-finite event")],
)
def test_the_scripts_own_failure_and_exit_status(script, tmp_path, mode: str, status: int, shown: str) -> None:
    done = run("run", str(script), mode, cwd=tmp_path)
    assert done.returncode == status
    assert shown in done.stderr
    assert "runpy" not in done.stderr


def test_no_command_is_a_usage_error_exiting_2(tmp_path) -> None:
    done = run(cwd=tmp_path)
    assert done.returncode == 2
    assert "usage: python -m nan_magic" in done.stderr


@pytest.mark.parametrize(
    "args",
    [["run", "--bogus", "train.py"], ["run", "missing.py"], ["run", "--kinds", "zero", "train.py"], ["run"]],
)
def test_usage_errors_exit_2_before_running_anything(tmp_path, monkeypatch, capsys, args: list[str]) -> None:
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert "usage: python -m nan_magic" in capsys.readouterr().err


def test_a_dump_that_cannot_be_written_is_reported_and_the_status_stays_1(script, tmp_path) -> None:
    (tmp_path / "blocker").write_text("a file, not a folder")
    done = run("run", "--dump", "blocker/scenes", str(script), "fail", cwd=tmp_path)
    assert done.returncode == 1
    assert "could not save the scene in blocker/scenes" in done.stderr
    assert "could not write blocker/scenes/nan_report.html" in done.stderr


def test_show_prints_a_scenes_report_with_the_fixes_tried(script, tmp_path) -> None:
    assert run("run", "--dump", "scenes", str(script), "fail", cwd=tmp_path).returncode == 1
    done = run("show", "scenes/nan_scene_step2.pt", "--json", "shown.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("nan_magic: first non-finite value in forward step 2: 1 (Norm), op aten.div.Tensor")
    # (centred / sqrt(mean(centred ** 2)) of a zero row: a norm of 0, 0 / 0: eps added to it, fixes-s35)
    assert "Fixes tried on a replay of step 2" in done.stdout and "eps: its denominator plus" in done.stdout
    assert json.loads((tmp_path / "shown.json").read_text())["fixes"][0]["kind"] == "eps"


@pytest.mark.parametrize(("name", "text", "error"), [
    ("notes.txt", "not a scene", "notes.txt is not a nan_magic scene file"),
    ("missing.pt", None, "no such scene file: missing.pt"),
])
def test_show_refuses_what_is_no_scene_in_one_line(tmp_path, name: str, text: str | None, error: str) -> None:
    if text is not None:
        (tmp_path / name).write_text(text)
    done = run("show", name, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == f"python -m nan_magic: error: {error}"
