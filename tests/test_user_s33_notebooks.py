"""Session 33's five walk notebooks (tests/notebooks/user_s33/), executed by nbclient in a real kernel.

Each is what a person writes, split over cells, with a helper ``train_one_epoch(...)`` defined in one cell and called
in another: a small U-Net whose loss divides a foreground BCE by the mask's pixel count (0 on a slide without a
lesion), under ``%%nantrace`` with a mistyped option first; a two-tower recommender whose hand-written cosine divides by
the norm of a padding item's all-zero embedding, under ``%nanwatch on`` with ``--ops=yes`` first; a REINFORCE bandit
whose annealed temperature drives a softmax probability to 0 under an entropy bonus written ``-(p * log p)``; house
prices from a pandas DataFrame whose derived feature ``rooms / sqft`` is inf for a listing with sqft 0 (a data
incident); a Poisson GLM fed a raw year (its exp underflows to 0, then log), after a cell the person interrupts.
Each asserts on what the person reads: the short error, the report's facts and fixes, ``%debug`` at the failing line
(inside the helper or the module defined in another cell) with its locals and ``up``, ``%nanwatch status``/``off``,
the interrupted cell leaving nothing behind, and the cell re-run after the fix. Run on Colab's stack too (scripts/test's
Colab list): the two stacks showed the same short errors and reports (only file names and IPython's own %tb differ).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jupyter_support import cell_text, named_cell, printed, report_text, run_copy, short_error

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

WALK = Path(__file__).parent / "notebooks" / "user_s33"


def run(name: str, tmp_path: Path) -> Any:
    return run_copy(WALK, name, tmp_path)


def test_the_unet_whose_empty_mask_divides_zero_by_zero(tmp_path: Path) -> None:
    nb = run("unet_dice.ipynb", tmp_path)
    (usage,) = cell_text(named_cell(nb, "bad_option")).strip().splitlines()
    assert usage.startswith("UsageError: %%nantrace: unrecognized arguments: --step; the options are --defer,"), usage
    short = short_error(named_cell(nb, "train"))
    # 16 images a batch: image 53 (empty) is batch 3's 6th: step 3, index 5
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 3: code outside any watched module",
                         "  op aten.div.Tensor at Cell In[3], line 22 (1 nan of 16)"], short
    assert "Cell In[4], line 5, in train_one_epoch" in short and "producer: Cell In[3], line 22, in seg_loss" in short
    assert len(short) <= 10, short
    summary = cell_text(named_cell(nb, "summary"))
    # Was "divided by zero (`other` (16,) held 1 zero of 16)": which tensor was `other`?
    assert summary.startswith("forward None aten.div.Tensor 22 3\ndivision-by-zero: aten.div.Tensor in the code at "
                              "Cell In[3], line 22 divided by zero (`target.sum((1, 2, 3))` (16,) held 1 zero of 16), "
                              "giving 1 NaN (0/0)"), summary
    assert "\neps True " in summary
    text = report_text(named_cell(nb, "train"))
    assert "  first at    index (5,)" in text and "1 of 1 verified" in text
    assert "target.sum((1, 2, 3)) (other of aten.div.Tensor)" in text  # its histogram
    assert "%debug opens in Cell In[3], line 22, in seg_loss" in text
    debug = cell_text(named_cell(nb, "debug"))  # in seg_loss (cell 3), then `up` into the helper (cell 4)
    assert "---> 22     fg_bce = (bce * target).sum((1, 2, 3)) / target.sum((1, 2, 3))" in debug
    assert "torch.Size([16, 1, 32, 32])" in debug and "49.,   0.,  49." in debug
    assert "----> 5         loss = seg_loss(model(images[i:i + bs]), masks[i:i + bs])" in debug
    assert debug.rstrip().endswith("48")
    assert cell_text(named_cell(nb, "tb")).rstrip().endswith("(1 nan of 16)")
    assert printed(named_cell(nb, "rerun")).startswith("done 2 ")


def test_the_recommender_whose_padding_item_has_no_norm(tmp_path: Path) -> None:
    nb = run("recsys_cosine.ipynb", tmp_path)
    # Was argparse's "argument --ops: ignored explicit argument 'yes'"
    assert cell_text(named_cell(nb, "bad_option")).strip() == (
        "UsageError: %nanwatch: --ops takes no value: write --ops alone, not --ops=yes")
    assert cell_text(named_cell(nb, "watch")).strip() == (
        "nan_magic: watching every cell (every module called) until %nanwatch off")
    short = short_error(named_cell(nb, "train"))
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 0: TwoTower (root)",
                         "  op aten.div.Tensor at Cell In[3], line 8 (2 nan of 50)"], short
    assert "Cell In[3], line 14, in forward" in short and "producer: Cell In[3], line 8, in cosine" in short
    summary = cell_text(named_cell(nb, "summary"))
    assert summary.startswith("forward '' aten.div.Tensor 8 0\ndivision-by-zero: aten.div.Tensor in TwoTower (root) "
                              "divided by zero (`a.norm(dim=-1) * b.norm(dim=-1)` (10, 5) held 2 zeros of 50)"), summary
    text = report_text(named_cell(nb, "train"))
    assert "  first at    index (7, 3)" in text
    assert "suggested edit (not applied): Cell In[3], line 8: return (a * b).sum(-1) / (a.norm(dim=-1) * " \
           "b.norm(dim=-1)).clamp_min(1.2e-07)" in text
    debug = cell_text(named_cell(nb, "debug"))  # in the module's method (cell 3), called from the helper (cell 4)
    assert "----> 8         return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))" in debug
    assert "torch.Size([10, 5, 32])" in debug and "5.9247, 6.1906, 0.0000, 0.0000]" in debug
    assert "---> 14         att = self.cosine(h, c[:, None]).softmax(-1)" in debug and "0,   0])" in debug
    assert "last report: first non-finite value in forward step 0: TwoTower (root)" in cell_text(
        named_cell(nb, "status"))
    assert printed(named_cell(nb, "rerun")).startswith("done 19 ")
    assert cell_text(named_cell(nb, "off")).strip() == "nan_magic: watch off"
    assert cell_text(named_cell(nb, "hooks")).split() == ["0"]


def test_the_bandit_whose_annealed_softmax_reaches_zero(tmp_path: Path) -> None:
    nb = run("reinforce_entropy.ipynb", tmp_path)
    short = short_error(named_cell(nb, "train"))
    # 5 episodes an epoch: step 45 is epoch 9 (`p epoch` says 9)
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 45: code outside any watched module",
                         "  op aten.log.default at Cell In[4], line 6 (128 -inf of 384)"], short
    assert "producer: Cell In[4], line 6, in train_one_epoch" in short and len(short) <= 8, short
    summary = cell_text(named_cell(nb, "summary"))
    # Was "log got 128 zeros and 0 negatives in `self` of aten.log.default in ..."
    assert summary.startswith("forward None aten.log.default 6 45\nlog-domain: log got 128 zeros and 0 negatives in "
                              "`probs` (`self` of aten.log.default in the code at Cell In[4], line 6)"), summary
    assert "\neps True " in summary
    text = report_text(named_cell(nb, "train"))
    assert "suggested edit (not applied): Cell In[4], line 6: logp = torch.log(probs.clamp_min(1.2e-07))" in text
    debug = cell_text(named_cell(nb, "debug"))
    assert "----> 6         logp = torch.log(probs)" in debug and "tensor(0., grad_fn=<MinBackward1>)" in debug
    assert "0.0403536" in debug  # tau
    assert "----> 3     r = train_one_epoch(policy, opt, tau=0.7 ** epoch)" in debug and debug.rstrip().endswith("9")
    assert printed(named_cell(nb, "rerun")).startswith("done 39 ")


def test_the_house_prices_whose_derived_feature_is_inf(tmp_path: Path) -> None:
    nb = run("housing_ratio.ipynb", tmp_path)
    short = short_error(named_cell(nb, "train"))
    # 64 rows a batch: listing 300 is batch 4's row 44; its 5th feature (rooms / sqft) is inf
    assert short[0] == "NonFiniteError: first non-finite input[0] in data step 4: Sequential (root) (1 +inf of 320)"
    assert "Cell In[4], line 3, in train_one_epoch" in short and len(short) <= 8, short
    summary = cell_text(named_cell(nb, "summary"))
    assert summary.startswith("data '' None None 4\nbad-input-data: input[0] entering model already held 1 +inf of "
                              "320 (first at index (44, 4))"), summary
    assert "\nskip-batch True the batch without its 1 of 64 samples holding non-finite values (row 44)" in summary
    text = report_text(named_cell(nb, "train"))
    # the data, not a layer: which sample, and where it is stored
    assert "it is stored in the dataset itself, at index 300 (dataset[300] shows it)" in text
    assert "local xb: f32[64,5] 1 +inf" in text
    debug = cell_text(named_cell(nb, "debug"))
    assert "----> 3         loss = F.mse_loss(model(xb).squeeze(-1), yb)" in debug
    assert "torch.Size([64, 5])" in debug and "tensor([[44,  4]])" in debug
    assert cell_text(named_cell(nb, "off")).strip() == "nan_magic: watch off"
    assert printed(named_cell(nb, "rerun")).startswith("done 4 ")


def test_the_poisson_glm_fed_a_raw_year_after_an_interrupted_cell(tmp_path: Path) -> None:
    nb = run("poisson_year.ipynb", tmp_path)
    interrupted = named_cell(nb, "interrupt")
    (error,) = [output for output in interrupted.outputs if output.output_type == "error"]
    assert error.ename == "KeyboardInterrupt"
    # nothing left on the model, anomaly mode off, and the next cell runs clean
    assert cell_text(named_cell(nb, "after_interrupt")).split() == ["0", "0", "False", "4.475"]
    short = short_error(named_cell(nb, "train"))
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 0: code outside any watched module",
                         "  op aten.log.default at Cell In[4], line 4 (64 -inf of 64)"], short
    summary = cell_text(named_cell(nb, "summary"))
    assert summary.startswith("forward None aten.log.default 4 0\nlog-domain: log got 64 zeros and 0 negatives in "
                              "`rate` (`self` of aten.log.default"), summary
    text = report_text(named_cell(nb, "train"))
    # the eps is verified but said to hide the inf: every value was 0 (the raw year, 2023, shows in the table)
    assert "the inf is hidden, not fixed: look at why every value is there" in text
    # (its columns as wide as the widest row's: since session 46 the producer's row is the log's own output)
    assert "PoissonGLM (root) data input[0] float32 64x2 -2.473 2023" in " ".join(text.split())
    debug = cell_text(named_cell(nb, "debug"))
    assert "----> 4         loss = (rate - counts[i:i + bs] * torch.log(rate)).mean()" in debug
    assert "tensor(0., grad_fn=<MaxBackward1>)" in debug and "tensor(2023.)" in debug
    assert "----> 3     print(epoch, train_one_epoch(glm, opt))" in debug and debug.rstrip().endswith("0")
    assert printed(named_cell(nb, "rerun")).startswith("done 4 ")
