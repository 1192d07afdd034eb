"""Session 29's five walk notebooks (tests/notebooks/user_s29/), executed by nbclient in a real kernel.

Each is what a person writes: a BERT-style classifier built from code whose batch 6 holds an all-padding example
(model, data and loop in cells of their own, under ``%nanwatch on``), a VAE whose posterior variance a warm-up hack
pushes up until Adam's state overflows, a GAN whose discriminator saturates into log(0), a diffusion toy whose noise
schedule ends at beta 1 (with a mistyped option first), and a tabular MLP fed a CSV with one missing value in batch
17. Each asserts on what the person reads: the short error, the report's facts, the fixes tried, ``%debug`` at the
line with its locals, and the cell re-run after the fix. Run on Colab's stack too (scripts/test's Colab list): the
two stacks showed the same report, line for line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jupyter_support import cell_text, named_cell, report_text, run_copy, short_error, widget_states

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

WALK = Path(__file__).parent / "notebooks" / "user_s29"


def run(name: str, tmp_path: Path) -> Any:
    return run_copy(WALK, name, tmp_path)


def test_the_bert_style_fine_tune_split_over_cells(tmp_path: Path) -> None:
    nb = run("hf_finetune.ipynb", tmp_path)
    short = short_error(named_cell(nb, "loop"))
    assert short[0] == "NonFiniteError: first non-finite value in forward step 6: encoder.0.attention (SelfAttention)"
    assert "producer: Cell In[2], line 11, in forward" in short and "    probs = scores.softmax(-1)" in short, short
    assert len(short) <= 12 and short[-1].startswith("%tb shows the full traceback"), short
    assert cell_text(named_cell(nb, "summary")).startswith("forward 'encoder.0.attention' aten._softmax.default 11 6")
    assert cell_text(named_cell(nb, "fixes")).startswith("mask ") and " True " in cell_text(named_cell(nb, "fixes"))
    text = report_text(named_cell(nb, "loop"))
    assert "suggested edit (not applied): Cell In[2], line 11: probs = scores.softmax(-1).nan_to_num(0.0)" in text
    assert "no loss: the failing step stopped before its loss code ran" in text
    assert "last report: first non-finite value in forward step 6" in cell_text(named_cell(nb, "status"))
    assert cell_text(named_cell(nb, "hooks")).split() == ["0"]  # after %nanwatch off
    states = json.dumps(widget_states(nb))
    assert all(title in states for title in ("Summary", "Layers", "Histograms", "Debug", "History"))


def test_the_vae_whose_adam_state_overflows(tmp_path: Path) -> None:
    nb = run("vae_kl.ipynb", tmp_path)
    short = short_error(named_cell(nb, "train"))
    assert short[0] == ("NonFiniteError: first non-finite state exp_avg_sq of logvar.weight in optimizer step 20: "
                        "logvar (Linear)"), short
    assert cell_text(named_cell(nb, "summary")).startswith("optimizer 'logvar' aten.addcmul_.default 8 20")
    assert "lr: the Adam step redone at a tenth of its learning rate (0.001 -> 0.0001) -> not tried: no last good " \
           "state was kept (%%nantrace --keep-last-good" in report_text(named_cell(nb, "train"))
    debug = cell_text(named_cell(nb, "debug"))
    assert "(8)" in debug.splitlines()[0] and "----> 8     opt.zero_grad(); loss.backward(); opt.step()" in debug
    assert "\n20\n" in debug  # `p step`: the failing step's own locals
    assert cell_text(named_cell(nb, "tb")).rstrip().endswith("(65 +inf of 128)")
    assert cell_text(named_cell(nb, "rerun")).startswith("done 59 ")


def test_the_gan_whose_discriminator_saturates(tmp_path: Path) -> None:
    nb = run("gan_saturate.ipynb", tmp_path)
    short = short_error(named_cell(nb, "train"))
    assert short[0] == "NonFiniteError: first non-finite value in forward step 17: code outside any watched module"
    assert "    d_loss = -(torch.log(D(real)) + torch.log(1 - D(fake.detach()))).mean()" in short, short
    assert cell_text(named_cell(nb, "summary")).startswith("forward None aten.log.default 5 17")
    assert cell_text(named_cell(nb, "fixes")).startswith("eps ")
    shown = [output.output_type for output in named_cell(nb, "report").outputs]
    assert shown == ["display_data", "execute_result"], shown  # the static twin, then the widget
    states = json.dumps(widget_states(nb))
    assert "Sequential (root) in D" in states and "input[0] of D" in states  # the Layers and Histograms tabs


def test_the_diffusion_toy_with_a_bad_schedule(tmp_path: Path) -> None:
    nb = run("diffusion_schedule.ipynb", tmp_path)
    (usage,) = cell_text(named_cell(nb, "bad_option")).strip().splitlines()
    assert usage.startswith("UsageError: %%nantrace: unrecognized arguments: --fixes (did you mean --no-fixes?)")
    short = short_error(named_cell(nb, "train"))
    assert short[0] == "NonFiniteError: first non-finite state exp_avg_sq of net.0.weight in optimizer step 0: net.0 " \
                       "(Linear)", short
    assert cell_text(named_cell(nb, "summary")).startswith("optimizer 'net.0' aten.addcmul_.default 11 0")
    assert "  note        no fix was tried: the trials of the Adam step (a tenth of its learning rate, a larger eps) " \
           "leave its gradient as large as it was" in report_text(named_cell(nb, "train"))
    debug = cell_text(named_cell(nb, "debug"))
    assert "tensor(5.7244e-31)" in debug and "torch.Size([64, 16])" in debug  # ab.min(), x_t.shape at the line


def test_the_tabular_mlp_with_one_missing_value(tmp_path: Path) -> None:
    nb = run("tabular_nan_row.ipynb", tmp_path)
    short = short_error(named_cell(nb, "train"))
    assert short[0] == "NonFiniteError: first non-finite input[0] in data step 17: Sequential (root) (1 nan of 192)"
    assert cell_text(named_cell(nb, "summary")).startswith("data '' None None 17")
    text = cell_text(named_cell(nb, "text"))
    assert "(row 5) -> verified through the model only: its forward and a stand-in backward came out finite" in text
    assert "it is stored in the dataset itself, at index 549 (dataset[549] shows it)" in text
    assert cell_text(named_cell(nb, "rerun")).replace("\n", "").startswith("done 62 ")
