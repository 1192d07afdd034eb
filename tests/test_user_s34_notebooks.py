"""Session 34's five walk notebooks (tests/notebooks/user_s34/), executed by nbclient in a real kernel.

Each is what a person writes: data in one cell, the model in another, a helper defined in an earlier cell, the loop
under ``%%nantrace`` or ``%nanwatch on``, after a mistyped magic. A tabular regressor whose per-batch standardisation
``(x - x.mean(0)) / x.std(0)`` meets a yes/no column that is all 0 in batch 3; a classifier under a focal loss
``(1 - pt) ** 0.5`` whose backward is infinite for a sample it is sure of (pt == 1.0), in a loop split over two cells;
SGD on raw, unscaled features (income in dollars) that diverges to inf; a Beta regression whose fraction target holds
a 1.0 (``Beta.log_prob``'s xlogy); a SAC-style policy whose log-prob correction takes ``atanh`` of a replayed action
clipped to exactly 1.0. Each asserts the short error, the report's facts, ``%debug`` at the failing line with its
locals and ``up``, the magics' one-line answers to bad input (nothing attached), the re-run after the fix, and that the
same code as a plain script under ``python -m nan_magic run`` names the same event. Run on Colab's stack too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_support import REPO, cell_text, named_cell, printed, report_text, run_copy, short_error

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

WALK = Path(__file__).parent / "notebooks" / "user_s34"


def run(name: str, tmp_path: Path) -> Any:
    return run_copy(WALK, name, tmp_path)


def one_line(cell: Any) -> str:
    (line,) = cell_text(cell).strip().splitlines()
    return line


_PLACE = re.compile(r"Cell In\[\d+\], line \d+|\S+\.py:\d+")


def as_script(name: str, cells: tuple[str, ...], tmp_path: Path) -> str:
    """The notebook's ``cells`` as one plain script (magic lines left out) run by ``python -m nan_magic run``: its
    error line, the place written as ``LOC``."""
    nb = nbformat.read(WALK / name, as_version=4)
    source = {cell.metadata["name"]: cell.source for cell in nb.cells}
    script = tmp_path / "train.py"
    script.write_text("\n".join(line for key in cells for line in source[key].splitlines()
                                if not line.startswith("%")) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "nan_magic", "run", str(script)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("nan_magic.errors.exceptions.")]
    return _PLACE.sub("LOC", error.removeprefix("nan_magic.errors.exceptions."))


def notebook_said(short: list[str]) -> str:
    """The short error's two lines as the script's one: ``<headline>, op <op> at LOC (<counts>)``."""
    return _PLACE.sub("LOC", f"{short[0]}, {short[1].strip()}")


_TRAIN_CELLS = ("setup", "data", "model", "helper", "train")


def assert_reran_and_script_agrees(nb: Any, name: str, short: list[str], tmp_path: Path, done: str | None = "done ",
                                   cells: tuple[str, ...] = _TRAIN_CELLS) -> None:
    """The re-run after the fix printed ``done`` (None: the walk has none), and the same code as a plain script
    under ``python -m nan_magic run`` names the event the notebook's short error named."""
    if done is not None:
        assert printed(named_cell(nb, "rerun")).startswith(done)
    script = as_script(name, cells, tmp_path)
    assert script == notebook_said(short), script


def test_the_regressor_whose_batch_standardisation_meets_a_constant_column(tmp_path: Path) -> None:
    name = "tabular_batch_std.ipynb"
    nb = run(name, tmp_path)
    assert one_line(named_cell(nb, "bad_option")).startswith(
        "UsageError: %%nantrace: unrecognized arguments: --mode (did you mean --full? watch()'s mode=\"full\" is "
        "--full here); the options are --defer,")
    assert one_line(named_cell(nb, "bad_target")) == (
        "UsageError: %%nantrace: cannot evaluate target 'regg': name 'regg' is not defined")
    assert cell_text(named_cell(nb, "unchanged")).split() == ["0", "0", "0.5446"]  # no hook, no step taken
    short = short_error(named_cell(nb, "train"))
    # 32 rows a batch: rows 96-127 are batch 3, where column 5 is all 0
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 3: norm (BatchStandardize)",
                         "  op aten.div.Tensor at Cell In[3], line 3 (32 nan of 192)"], short
    assert "Cell In[4], line 3, in fit_epoch" in short and "producer: Cell In[3], line 3, in forward" in short
    assert len(short) <= 12, short
    summary = cell_text(named_cell(nb, "summary"))
    # Was "divided by zero (`other` (6,) held 1 zero of 6)"
    assert summary.startswith("forward 'norm' aten.div.Tensor 3 3\ndivision-by-zero: aten.div.Tensor in norm "
                              "(BatchStandardize) divided by zero (`x.std(0)` (6,) held 1 zero of 6), giving 32 NaN"), \
        summary
    text = report_text(named_cell(nb, "train"))
    # (a forward event stops before the loss code: its trial is verified through the model only, session 46's title)
    assert "  first at    index (0, 5)" in text and "0 of 1 verified, 1 through the model only" in text
    # Was said only where the failing step was the watch's first (the split cell below), not at step 3
    assert "step 3: input[0]: 1 of 6 features is constant over the batch of 32 rows: feature 5 (= 0); " \
        "standardising it divides by a zero std" in text
    assert "suggested edit (not applied): Cell In[3], line 3: return (x - x.mean(0)) / x.std(0).clamp_min(1.2e-07)" \
        in text
    debug = cell_text(named_cell(nb, "debug"))  # in the module (cell 3), `up` twice into the helper (cell 4)
    assert "----> 3         return (x - x.mean(0)) / x.std(0)" in debug
    assert "torch.Size([32, 6])" in debug and "0.8902, 0.0000])" in debug
    assert "----> 3         loss = F.mse_loss(model(X[i:i + bs]), y[i:i + bs])" in debug
    assert debug.rstrip().endswith("96")
    # the forward alone in a cell of its own: its own step 0, same module, op and line
    split = short_error(named_cell(nb, "split_forward"))
    assert split[:2] == ["NonFiniteError: first non-finite value in forward step 0: norm (BatchStandardize)",
                         "  op aten.div.Tensor at Cell In[3], line 3 (32 nan of 192)"], split
    assert "feature 5 (= 0); standardising it divides by a zero std" in report_text(named_cell(nb, "split_forward"))
    assert_reran_and_script_agrees(nb, name, short, tmp_path, done="done 1 ")


def test_the_focal_loss_whose_backward_is_infinite_for_a_sure_sample(tmp_path: Path) -> None:
    name = "focal_pow.ipynb"
    nb = run(name, tmp_path)
    assert one_line(named_cell(nb, "bad_option")) == (
        "UsageError: %nanwatch: 'of' is not on, off or status, nor a name defined here (the models, optimizers or "
        "GradScalers to watch)")
    assert one_line(named_cell(nb, "bad_value")) == "UsageError: %nanwatch: argument --dump: expected one argument"
    assert one_line(named_cell(nb, "watch")) == (
        "nan_magic: watching every cell (every module called) until %nanwatch off")
    assert cell_text(named_cell(nb, "split_forward")).strip() == ""  # the forward cell is healthy
    short = short_error(named_cell(nb, "split_step"))  # the step's cell: the backward of the forward cell's loss
    # sample 70 (X = 60) is batch 64-95's 7th: sigmoid rounds to 1.0, and (1 - pt) ** 0.5 has an infinite slope at 0
    assert short[:2] == ["NonFiniteError: first non-finite grad of model output in backward step 0: code outside any "
                         "watched module",
                         "  op aten.pow.Tensor_Scalar at Cell In[4], line 4 (1 nan of 32 in grad of model output)"
                         ], short
    assert "Cell In[9], line 2" in short and "producer: Cell In[4], line 4, in focal_loss" in short
    summary = cell_text(named_cell(nb, "summary"))
    assert summary.startswith("backward None aten.pow.Tensor_Scalar 4 0\npow-domain: the derivative of x**p for p < 1 "
                              "is infinite at x = 0, reached by pow at Cell In[4], line 4"), summary
    assert "\neps True " in summary
    debug = cell_text(named_cell(nb, "debug"))
    assert "----> 4     return (-(1 - pt) ** gamma * torch.log(pt.clamp_min(1e-8))).mean()" in debug
    assert debug.rstrip().endswith("0.5")
    assert "last report: first non-finite grad of model output in backward step 0" in cell_text(
        named_cell(nb, "status"))
    # the whole loop in one cell: batch 64-95 is step 2
    loop = short_error(named_cell(nb, "train"))
    assert loop[0].endswith("in backward step 2: code outside any watched module"), loop
    assert cell_text(named_cell(nb, "summary2")).startswith("backward None aten.pow.Tensor_Scalar 4 2\n")
    assert one_line(named_cell(nb, "off")) == "nan_magic: watch off"
    assert cell_text(named_cell(nb, "hooks")).split() == ["0"]
    assert_reran_and_script_agrees(nb, name, short, tmp_path, done=None,
                                   cells=("setup", "data", "model", "helper", "split_forward", "split_step"))


def test_sgd_on_unscaled_features_diverges_and_says_the_learning_rate(tmp_path: Path) -> None:
    name = "unscaled_sgd.ipynb"
    nb = run(name, tmp_path)
    assert one_line(named_cell(nb, "bad_option")) == (
        "UsageError: %%nantrace: --warn takes no value: write --warn alone, not --warn=always")
    short = short_error(named_cell(nb, "train"))
    assert short[:2] == ["NonFiniteError: first non-finite loss in forward step 3: code outside any watched module",
                         "  op aten.mse_loss.default at Cell In[4], line 4 (1 +inf of 1)"], short
    summary = cell_text(named_cell(nb, "summary"))
    assert summary.startswith("forward None aten.mse_loss.default 4 3\nlearning-rate-too-high: the loss rose to "), \
        summary
    assert "lower the learning rate (e.g. 10x)" in summary
    debug = cell_text(named_cell(nb, "debug"))
    assert "----> 4         loss = F.mse_loss(model(X[i:i + bs]), y[i:i + bs])" in debug
    assert "tensor(inf, grad_fn=<MseLossBackward0>)" in debug
    assert_reran_and_script_agrees(nb, name, short, tmp_path, )


def test_the_beta_regression_whose_target_holds_a_one(tmp_path: Path) -> None:
    name = "beta_fraction.ipynb"
    nb = run(name, tmp_path)
    assert one_line(named_cell(nb, "bad_option")) == "UsageError: %%nantrace: argument --dump: expected one argument"
    short = short_error(named_cell(nb, "train"))
    # 40 rows a batch: row 137 is batch 3's 18th (index 17)
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 3: code outside any watched module",
                         "  op aten.xlogy.Tensor at Cell In[4], line 3 (1 +inf of 80)"], short
    assert "producer: Cell In[4], line 3, in nll" in short
    summary = cell_text(named_cell(nb, "summary"))
    # Was "unclassified: ... its inputs reached |x| = 1; no rule of the checklist matches"
    assert summary.startswith("forward None aten.xlogy.Tensor 3 3\nlog-domain: xlogy got 1 zero and 0 negatives in "
                              "`other` of aten.xlogy.Tensor"), summary
    text = report_text(named_cell(nb, "train"))
    assert "  first at    index (17, 1)" in text
    debug = cell_text(named_cell(nb, "debug"))
    assert "----> 3     return -Beta(a, b).log_prob(yb).mean()" in debug and "tensor(1.)" in debug
    assert "----> 7         loss = nll(model, X[i:i + bs], frac[i:i + bs])" in debug
    assert debug.rstrip().endswith("120")
    assert_reran_and_script_agrees(nb, name, short, tmp_path, )


def test_the_policy_whose_replayed_action_sits_on_tanhs_bound(tmp_path: Path) -> None:
    name = "sac_atanh.ipynb"
    nb = run(name, tmp_path)
    assert one_line(named_cell(nb, "bad_option")) == (
        "UsageError: %nanwatch: cannot evaluate target 'pii': name 'pii' is not defined")
    assert one_line(named_cell(nb, "watch")) == (
        "nan_magic: watching every cell (pi; 1 optimizer(s)) until %nanwatch off")
    short = short_error(named_cell(nb, "train"))
    # 50 actions a batch: action 211 is batch 4's
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 4: code outside any watched module",
                         "  op aten.atanh.default at Cell In[3], line 12 (1 +inf of 50)"], short
    assert "Cell In[4], line 3, in bc_epoch" in short and "producer: Cell In[3], line 12, in log_prob" in short
    summary = cell_text(named_cell(nb, "summary"))
    assert summary.startswith("forward None aten.atanh.default 12 4\nlog-domain: atanh in the code at Cell In[3], "
                              "line 12 got 1 value at ±1 and 0 past them"), summary
    assert "\neps True " in summary
    debug = cell_text(named_cell(nb, "debug"))
    assert "---> 12         u = torch.atanh(a)" in debug and "tensor(1.)" in debug
    assert "----> 3         loss = -policy.log_prob(obs[i:i + bs], actions[i:i + bs]).mean()" in debug
    assert debug.rstrip().endswith("200")
    assert one_line(named_cell(nb, "off")) == "nan_magic: watch off"
    assert_reran_and_script_agrees(nb, name, short, tmp_path, done="done 2 ")
