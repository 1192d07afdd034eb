"""A value loaded non-finite by ``load_state_dict`` while the watch is on: the report names that line
(patches/loads.py).

A run resumed from a checkpoint saved after it went bad meets the NaN at the next forward (a parameter) or step (an
optimizer state), where no op of the run made it. Before session 47 the report named the module, phase and step and
said the value was already there ("a checkpoint load, a manual edit..."), with no line; now its source is the line
that loaded it, in every mode, with a note that says so. What was loaded finite, and what an op made non-finite
after a load, are reported as before.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from contract import MODE_OPTIONS
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.patches import registry
from nan_magic.patches.loads import _loaded, forget_loads, loaded_nonfinite, noted_loads

MODES = list(MODE_OPTIONS)
LOAD_AT = 2  # the loop loads the checkpoint after this step's optimizer step


def _line_of(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    (index,) = [i for i, line in enumerate(lines) if text in line]
    return first + index


def _run(kind: str, value: float, before_watch: bool = False, op_after: bool = False):
    """Six steps of a small classifier; after step 2 the loop loads a checkpoint taken at step 1 whose ``kind``
    (``"model"``: 0.weight; ``"optimizer"``: Adam's exp_avg of 0.weight) holds ``value`` at one element.
    ``before_watch``: loaded before the watch, not in the loop. ``op_after``: a finite checkpoint, and the loop's
    forward divides by zero at step 4 (an op's NaN after a load)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(6, 5) for _ in range(6)], [torch.randint(0, 3, (6,)) for _ in range(6)]
    for _ in range(2):
        F.cross_entropy(model(xs[0]), ys[0]).backward()
        opt.step()
        opt.zero_grad()
    saved = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())}
    if kind == "model":
        saved["model"]["0.weight"][0, 0] = value
    else:
        saved["optimizer"]["state"][0]["exp_avg"][0, 0] = value

    def load() -> None:
        model.load_state_dict(saved["model"])  # the model's checkpoint
        opt.load_state_dict(saved["optimizer"])  # the optimizer's checkpoint

    if before_watch:
        load()

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(6):
            out = model(xs[step])
            if op_after and step == 4:
                out = out / (out - out)
            loss = F.cross_entropy(out, ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == LOAD_AT and not before_watch:
                load()
            losses.append(loss.detach())
        return losses

    return model, opt, run, load


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("kind", "value"), [("model", math.nan), ("model", math.inf), ("optimizer", math.nan)])
def test_a_checkpoint_loaded_nonfinite_is_named_at_its_load_line(mode: str, kind: str, value: float) -> None:
    model, opt, run, load = _run(kind, value)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]):
        run()
    report = caught.value.report
    line = _line_of(load, "model.load_state_dict" if kind == "model" else "opt.load_state_dict")
    assert report.op is None
    assert report.source is not None and (report.source.filename, report.source.lineno) == (__file__, line)
    assert report.module == "0" and report.step == LOAD_AT + 1
    if kind == "model":
        assert (report.phase, str(report.tensor)) == ("forward", "parameter 0.weight")
        loader = "a module's load_state_dict"
    else:
        assert (report.phase, str(report.tensor)) == ("data", "state exp_avg of 0.weight")
        loader = "the optimizer's load_state_dict"
    text = report.to_text()
    assert f"was non-finite as {loader} loaded it, at line {line}" in text, text
    assert f"0 (Linear) at tests/test_loaded_s47.py:{line}" in report.message, report.message


@pytest.mark.parametrize("mode", MODES)
def test_a_finite_checkpoint_loaded_in_the_loop_changes_nothing(mode: str) -> None:
    expected = _run("model", 0.5)[2]()
    model, opt, run, _load = _run("model", 0.5)
    with nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as watch:
        got = run()
    assert watch.report is None
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not _loaded  # the notes go with the watch


@pytest.mark.parametrize("mode", ["default", "defer", "ops"])
def test_an_ops_nonfinite_value_after_a_finite_load_names_the_op_not_the_load(mode: str) -> None:
    model, opt, run, _load = _run("model", 0.5, op_after=True)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]):
        run()
    report = caught.value.report
    assert report.op == "aten.div.Tensor" and report.step == 4
    assert "load_state_dict" not in report.to_text()


def test_a_checkpoint_loaded_before_the_watch_has_no_line() -> None:
    """The watch sees only the loads made while it is on: one before it is the value "already held" it was."""
    model, opt, run, _load = _run("model", math.nan, before_watch=True)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt):
        run()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.source) == ("forward", "0", 0, None)
    assert "load_state_dict loaded it" not in report.to_text()


def test_the_load_patches_go_with_the_watch_and_a_users_patch_made_inside_it_stays() -> None:
    model = nn.Linear(2, 2)
    bad = {key: torch.full_like(value, math.nan) for key, value in model.state_dict().items()}
    original = vars(nn.Module)["load_state_dict"]
    seen: list[str] = []
    with noted_loads():
        assert ("load_state_dict" in {name for _owner, name in registry.installed()})
        wrapped = nn.Module.load_state_dict

        def theirs(self, *args, **kwargs):
            seen.append("user")
            return wrapped(self, *args, **kwargs)

        nn.Module.load_state_dict = theirs
        model.load_state_dict(bad)
        assert seen == ["user"] and loaded_nonfinite(model.weight) is not None  # ours ran under theirs
    try:
        assert vars(nn.Module)["load_state_dict"] is theirs and registry.installed() == []
        forget_loads()  # (a watch that ended for good; a paused one keeps its notes for its next cell)
        assert not _loaded
        model.load_state_dict(bad)  # theirs runs; ours passes through, noting nothing
        assert seen == ["user", "user"] and loaded_nonfinite(model.weight) is None
    finally:
        nn.Module.load_state_dict = original
    assert vars(torch.optim.Optimizer)["load_state_dict"].__qualname__ == "Optimizer.load_state_dict"


def test_a_load_in_one_cell_of_a_nanwatch_on_run_is_named_in_the_next(ip) -> None:
    """``%nanwatch on`` leaves its watch paused between cells: what a cell loaded is kept for the next one."""
    ip.run_cell("""
import copy, math, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
xs, ys = [torch.randn(6, 5) for _ in range(3)], [torch.randint(0, 3, (6,)) for _ in range(3)]
ckpt = copy.deepcopy(model.state_dict()); ckpt["0.weight"][0, 0] = math.nan
""")
    ip.run_line_magic("nanwatch", "on")
    try:
        ip.run_cell("model.load_state_dict(ckpt)  # resumed")
        result = ip.run_cell("""
for step in range(3):
    loss = F.cross_entropy(model(xs[step]), ys[step])
    opt.zero_grad(); loss.backward(); opt.step()
""")
    finally:
        ip.run_line_magic("nanwatch", "off")
    report = ip.user_ns["_nan_report"]
    assert isinstance(result.error_in_exec, NonFiniteError)
    assert (report.phase, report.module, str(report.tensor)) == ("forward", "0", "parameter 0.weight")
    assert report.source is not None and report.source.line == "model.load_state_dict(ckpt)  # resumed"
    assert "a module's load_state_dict loaded it, at line 1" in report.to_text()
