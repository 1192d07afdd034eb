"""Session 30's five walk notebooks (tests/notebooks/user_s30/), executed by nbclient in a real kernel.

Each is what a person writes, split over cells: a char-level LSTM language model whose loss jumps at epoch 2 (a
learning rate multiplied by 100 instead of 10, and ``torch.log(logits.softmax(-1))``), under ``%nanwatch on``; a
SimCLR-style pair model whose temperature (0.01) overflows ``exp`` (with a mistyped option first), under
``%%nantrace``; a regression with a custom log loss of a linear head's output (a mistyped option, then ``%nanwatch
on``); a seq2seq GRU with teacher forcing whose masked cross-entropy meets an all-padding target in batch 9; and a
two-head model with two optimizers, the second an SGD at lr 1.0 on unnormalised prices. Each asserts on what the
person reads: the short error, the report's facts, the fixes tried and the suggested edit, ``%debug`` at the line
with its locals, ``%nanwatch status``/``off``, and the cell re-run after the fix. Run on Colab's stack too
(scripts/test's Colab list): the two stacks showed the same report, line for line (only file names differ).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jupyter_support import cell_text, named_cell, one_line_usage_error, report_text, run_copy, short_error

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

WALK = Path(__file__).parent / "notebooks" / "user_s30"


def run(name: str, tmp_path: Path) -> Any:
    return run_copy(WALK, name, tmp_path)


def test_the_char_lstm_whose_loss_jumps_at_epoch_2(tmp_path: Path) -> None:
    nb = run("char_lstm.ipynb", tmp_path)
    short = short_error(named_cell(nb, "train"))
    # 17 batches an epoch: epoch 2's 5th batch is the 39th iteration, step 38
    assert short[0] == ("NonFiniteError: first non-finite grad of model output in backward step 38: code outside "
                        "any watched module"), short
    assert "    log_probs = torch.log(logits.softmax(-1))" in short and len(short) <= 8, short
    assert cell_text(named_cell(nb, "summary")).startswith("backward None aten.div.Tensor 7 38\nlog-domain:")
    text = report_text(named_cell(nb, "train"))
    # It read "torch.log_softmax(-1)": the logits the softmax method was called on were dropped (render/fixes.py).
    assert "suggested edit (not applied): Cell In[5], line 7: log_probs = torch.log_softmax(logits, -1)" in text
    assert "stable: the log of the softmax fused into log_softmax -> verified" in text
    debug = cell_text(named_cell(nb, "debug"))
    assert "----> 7         log_probs = torch.log(logits.softmax(-1))" in debug
    assert "torch.Size([16, 32, 28])" in debug and "tensor(0., grad_fn=<MinBackward1>)" in debug and "\n2\n" in debug
    assert "last report: first non-finite grad of model output in backward step 38" in cell_text(
        named_cell(nb, "status"))
    assert cell_text(named_cell(nb, "off")).strip() == "nan_magic: watch off"
    assert cell_text(named_cell(nb, "hooks")).split() == ["0"]
    assert cell_text(named_cell(nb, "rerun")).splitlines()[-1].startswith("done 3 ")
    assert cell_text(named_cell(nb, "plain")).strip() == "332833500"  # a cell without torch under the watch


def test_the_simclr_pair_model_with_a_temperature_too_small(tmp_path: Path) -> None:
    nb = run("simclr_tau.ipynb", tmp_path)
    one_line_usage_error(named_cell(nb, "bad_option"), "UsageError: %%nantrace: unrecognized arguments: --tau;")
    short = short_error(named_cell(nb, "train"))
    # Step 1 (the encoder called again on the second view opens a step before opt has stepped) where the loop's own
    # step, `p step` below, is 0: a known limit (test_user_s30.py's strict xfail says why).
    assert short[0] == "NonFiniteError: first non-finite value in forward step 1: code outside any watched module"
    assert "    sim = torch.exp(z @ z.T / tau)" in short, short
    assert cell_text(named_cell(nb, "summary")).startswith("forward None aten.exp.default 8 1\nexp-overflow:")
    assert "\nstable True " in cell_text(named_cell(nb, "summary"))
    debug = cell_text(named_cell(nb, "debug"))
    assert "----> 8     sim = torch.exp(z @ z.T / tau)" in debug and "tensor(100.0000" in debug and "\n0.01\n" in debug
    assert "----> 6     loss = nt_xent(" in debug and debug.rstrip().endswith("0"), debug  # `up`, then `p step`
    assert cell_text(named_cell(nb, "tb")).rstrip().endswith("(4702 +inf of 16384)")
    assert cell_text(named_cell(nb, "rerun")).startswith("done 49 ")


def test_the_regression_with_a_log_loss(tmp_path: Path) -> None:
    nb = run("log_regression.ipynb", tmp_path)
    one_line_usage_error(named_cell(nb, "watch"), "UsageError: %nanwatch: unrecognized arguments: --bogus;")
    short = short_error(named_cell(nb, "train"))
    assert short[0] == "NonFiniteError: first non-finite value in forward step 0: code outside any watched module"
    assert "  op aten.log.default at Cell In[3], line 5 (31 nan of 32)" in short, short
    summary = cell_text(named_cell(nb, "summary"))
    assert summary.startswith("forward None aten.log.default 5 0\nlog-domain: log got 0 zeros and 31 negatives")
    assert "\neps True " in summary
    debug = cell_text(named_cell(nb, "debug"))
    assert "tensor(-0.7090, grad_fn=<MinBackward1>)" in debug and "torch.Size([32])" in debug
    assert "----> 4     loss = rmsle(pred, y[i])" in debug
    assert cell_text(named_cell(nb, "rerun")).startswith("done 199 ")


def test_the_seq2seq_whose_target_is_all_padding(tmp_path: Path) -> None:
    nb = run("seq2seq_pad.ipynb", tmp_path)
    short = short_error(named_cell(nb, "train"))
    assert short[0] == "NonFiniteError: first non-finite value in forward step 9: code outside any watched module"
    assert "    per_seq = (ce * mask).sum(1) / mask.sum(1)" in short, short
    assert cell_text(named_cell(nb, "summary")).startswith("forward None aten.div.Tensor 17 9\ndivision-by-zero:")
    text = report_text(named_cell(nb, "train"))
    assert "mask.sum(1) (other): f32[16] finite in [0, 7]" in text and "first at    index (3,)" in text
    debug = cell_text(named_cell(nb, "debug"))
    assert "tensor([2., 7., 1., 0., 6." in debug and "\n9\n" in debug
    shown = [output.output_type for output in named_cell(nb, "report").outputs]
    assert shown == ["display_data", "execute_result"], shown  # the static twin, then the widget
    assert cell_text(named_cell(nb, "rerun")).startswith("done 29 ")


def test_the_two_head_model_with_two_optimizers(tmp_path: Path) -> None:
    nb = run("multitask_two_opts.ipynb", tmp_path)
    short = short_error(named_cell(nb, "train"))
    # Two optimizers step each iteration: the step is still the loop's iteration (`p it` says 7)
    assert short[0] == ("NonFiniteError: first non-finite state exp_avg_sq of trunk.0.weight in optimizer step 7: "
                        "trunk.0 (Linear)"), short
    assert cell_text(named_cell(nb, "summary")).startswith("optimizer 'trunk.0' aten.addcmul_.default 8 7")
    assert cell_text(named_cell(nb, "debug")).rstrip().endswith("7")
    assert cell_text(named_cell(nb, "rerun")).startswith("done 99 ")


@pytest.mark.xfail(strict=True, reason=(
    "multitask_two_opts.ipynb: the price head's SGD (opt_b, lr 1.0, momentum 0.9, unnormalised targets) diverges "
    "and its huge gradients overflow the trunk's Adam state; the report's cause says 'lower the learning rate' and "
    "its lr trial redoes the Adam step at 0.001 -> 0.0001, never naming the SGD, the price head or its lr 1.0 (the "
    "price outputs were 1e11): the person lowers the wrong learning rate. Session 31 looked, not fixed: at the event "
    "the evidence is there (price.weight/bias |max| 8.7e9/1.9e10 against 0.25 for the trunk's, the loss x70 a step "
    "since step 0), but the cause (explain/optimizer.py, the diverged reading) and the trials (fixes/remedies/"
    "diverged.py, optimizer_step.py) know only the optimizer that stepped the non-finite tensor, and one update of "
    "the SGD redone at a tenth cannot make this step's Adam state finite (it diverged over 7 steps): naming the group "
    "whose parameters grew needs a per-group growth fact kept across steps, and a verified trial needs the steps "
    "since the growth began replayed"))
def test_the_two_head_model_s_report_names_the_optimizer_that_diverged(tmp_path: Path) -> None:
    nb = run("multitask_two_opts.ipynb", tmp_path)
    text = report_text(named_cell(nb, "train"))
    assert "SGD" in text and "price" in text.split("Layers of step")[0]
