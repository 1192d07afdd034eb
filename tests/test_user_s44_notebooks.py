"""Session 44's five notebook users (tests/notebooks/user_s44/), each run in a real kernel, on both stacks.

Users the earlier walks did not play, each with cells split as that person splits them, and the debugger driven as a
person drives it: ``%debug``'s ``ipdb>`` prompts answered over the kernel's stdin channel (tests/kernel_dialogue.py),
not with ``input`` patched in the namespace.

- A keyword spotter whose log-energy frames meet a microphone dropout: model and optimizer in one cell, ``%nanwatch
  on`` in the next, a healthy ``for`` of 50 steps, then a second ``for`` over new recordings that fails at its 7th
  iteration: step 56, the user's (one run across cells); ``%debug`` (``p``, ``u``, ``p``, ``q``) and ``%tb``.
- A soft-label KL loss written out in a function of its own cell (one-hot rows: ``0 * log 0``); the report read in the
  next cell (``to_json()``, ``.table``, ``.fixes``); the line fixed with ``xlogy`` and the same cell run again: silent,
  and the first report still there (``_nan_report``, its widget's stored state, the saved notebook exported to HTML:
  the static report, compact, its histograms, no error text in it).
- A Poisson autoencoder kept as a dict of two modules with an optimizer each, under ``%%nantrace --defer``; a first
  cell the person stops (SIGINT, the stop button), then the run whose sensor glitch overflows a hand-written softplus.
- A gesture model whose hand-written layer norm takes ``sqrt(E[x^2] - E[x]^2)`` of a stuck sensor's frame (negative by
  rounding), under ``%nanwatch on --full`` after a mistyped ``--modee``; ``%nanwatch status`` and ``off`` mid-run, the
  failing evaluation run unwatched (silent, as asked), then watched again.
- A click-through-rate regressor whose loop takes the logit of a rate of 1.0, under a bare ``%nanwatch`` (this cell
  only): a data event at the loop's line, and the next cell unwatched.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from jupyter_support import cell_text, named_cell, printed, report_text, short_error, widget_states
from kernel_dialogue import execute_in_dialogue

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

WALK = Path(__file__).parent / "notebooks" / "user_s44"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def run(name: str, tmp_path: Path, answers: dict[str, list[str]] | None = None,
        interrupted: dict[str, int] | None = None) -> Any:
    shutil.copy(WALK / name, tmp_path / name)
    return execute_in_dialogue(tmp_path / name, answers or {}, interrupted)


def arrow_at(text: str, lineno: int, line: str) -> bool:
    """Whether a debugger or ``%tb`` listing in ``text`` points at ``lineno`` holding ``line`` (IPython 7 and 8 pad
    the arrow and indent the excerpt differently)."""
    return re.search(rf"-+> {lineno} +{re.escape(line)}\n", text) is not None


def widget_summary(nb: Any, cell: Any) -> str:
    """The HTML of the Summary tab of the report widget ``cell`` displayed, from the notebook's stored widget state."""
    (view,) = [output.data[WIDGET_VIEW] for output in cell.outputs if WIDGET_VIEW in output.get("data", {})]
    states = widget_states(nb)
    tab = states[view["model_id"]]["state"]
    summary = states[tab["children"][0].removeprefix("IPY_MODEL_")]["state"]
    return str(summary["value"])


def test_a_loop_split_over_cells_fails_at_the_users_step_57(tmp_path: Path) -> None:
    nb = run("keyword_split_loop.ipynb", tmp_path, {
        "debug": ["p frames.shape", "p frames.pow(2).mean(-1)[5, 8].item()", "u", "p it", "p xb.shape", "q"]})
    assert printed(named_cell(nb, "warmup")).startswith("warm-up loss ")
    assert printed(named_cell(nb, "new_data")) == ""  # armed across cells: a cell without a model stays silent
    finetune = named_cell(nb, "finetune")
    assert printed(finetune).startswith("0 ") and "\n5 " in cell_text(finetune) and "\n6 " not in cell_text(finetune)
    short = short_error(finetune)
    # 50 optimizer steps in the warm-up cell, 6 in this one: the 57th step, step 56 (0-based), whichever cell
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 56: KeywordSpotter (root)",
                         "  op aten.log.default at Cell In[2], line 10 (1 -inf of 128)"], short
    assert short[2:4] == ["Cell In[6], line 3", "    loss = F.cross_entropy(model(xb), yb)"], short
    assert short[4:6] == ["producer: Cell In[2], line 10, in forward",
                          "    energy = torch.log(frames.pow(2).mean(-1))"], short
    text = report_text(finetune)
    assert "  first at    index (5, 8)\n" in text  # clip 53 is the 6th of batch 6; its frame 8 is samples 400-449
    assert "frames.pow(2).mean(-1) (self): f32[8,16] finite in [0, " in text
    assert "suggested edit (not applied): Cell In[2], line 10: energy = torch.log(frames.pow(2).mean(-1)" \
           ".clamp_min(1.2e-07))" in text
    summary = cell_text(named_cell(nb, "summary")).splitlines()
    assert summary[0] == "forward '' aten.log.default 10 56"
    assert summary[1].startswith("log-domain: log got 1 zero and 0 negatives in `frames.pow(2).mean(-1)`")
    assert "eps True the operand of log clamped to at least 1.19e-7 (the float32 machine eps)" in summary
    assert "step 56" in widget_summary(nb, finetune)
    debug = cell_text(named_cell(nb, "debug"))
    # %debug in the model's forward at the producing line, with that line's locals; `u` into the loop cell
    assert arrow_at(debug, 10, "energy = torch.log(frames.pow(2).mean(-1))"), debug
    assert "ipdb> p frames.shape\ntorch.Size([8, 16, 50])\n" in debug
    assert "ipdb> p frames.pow(2).mean(-1)[5, 8].item()\n0.0\n" in debug
    assert arrow_at(debug, 3, "loss = F.cross_entropy(model(xb), yb)"), debug
    assert "ipdb> p it\n6\n" in debug and "ipdb> p xb.shape\ntorch.Size([8, 800])\n" in debug
    tb = cell_text(named_cell(nb, "tb"))
    assert tb.rstrip().endswith(f"{short[0]}, {short[1].strip()}")
    assert arrow_at(tb, 3, "loss = F.cross_entropy(model(xb), yb)") and arrow_at(
        tb, 10, "energy = torch.log(frames.pow(2).mean(-1))"), tb
    assert "nan_magic/" not in tb  # the user's frames only
    assert "last report: first non-finite value in forward step 56" in cell_text(named_cell(nb, "status"))
    assert printed(named_cell(nb, "off")) == "nan_magic: watch off"
    assert printed(named_cell(nb, "hooks")) == "0 0 0"


def test_a_loss_function_fixed_and_its_cell_run_again(tmp_path: Path) -> None:
    nb = run("soft_label_refit.ipynb", tmp_path, {
        "debug": ["p target.shape", "p int((target == 0).sum())", "u", "p i", "q"]})
    train = named_cell(nb, "train")
    short = short_error(train)
    # rows 40 on are one-hot: the second batch (32-63) holds them; 0 * log(0) = 0 * -inf
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 1: code outside any watched module",
                         "  op aten.log.default at Cell In[3], line 3 (72 -inf of 128)"], short
    assert short[2:6] == ["Cell In[5], line 4", "    loss = soft_kl(model(texts[i:i + 32]), soft[i:i + 32])",
                          "producer: Cell In[3], line 3, in soft_kl",
                          "    return (target * (target.log() - logits.log_softmax(-1))).sum(-1).mean()"], short
    read = cell_text(named_cell(nb, "read")).splitlines()
    assert read[0] == "forward None aten.log.default 1 3"  # to_json(): plain data, read back
    assert read[2] == str(["call", "phase", "module", "type", "tensor", "dtype", "shape", "min", "max", "mean",
                           "std", "absmax", "nan", "+inf", "-inf", "status"])
    fixes = read[3:]
    assert fixes[0].startswith("eps True FixSite(op='aten.log.default', module=None, ") and fixes[0].endswith(
        "| the operand of log clamped to at least 1.19e-7 (the float32 machine eps)"), fixes
    assert fixes[1].startswith("stable None "), fixes  # not tried: nothing at that line to fuse
    text = report_text(train)
    assert "1 of 2 verified" in text and "suggested edit (not applied): Cell In[3], line 3:" in text
    debug = cell_text(named_cell(nb, "debug"))
    assert arrow_at(debug, 3, "return (target * (target.log() - logits.log_softmax(-1))).sum(-1).mean()"), debug
    assert "ipdb> p target.shape\ntorch.Size([32, 4])\n" in debug and "ipdb> p int((target == 0).sum())\n72\n" in debug
    assert arrow_at(debug, 4, "loss = soft_kl(model(texts[i:i + 32]), soft[i:i + 32])") and "ipdb> p i\n32\n" in debug
    # the line fixed, the same cell again: it runs to the end, silent, and the first report is still the last one
    again = named_cell(nb, "train_again")
    assert [output.output_type for output in again.outputs] == ["stream"], again.outputs
    assert printed(again).startswith("epoch 0 ") and " epoch 1 " in printed(again)
    assert printed(named_cell(nb, "after")) == "True 1"
    assert "code outside any watched module" in widget_summary(nb, train)  # the first report's widget, as stored
    # the saved notebook exported (no kernel, no widget manager): the static report stands under the cell, compact
    from nbconvert import HTMLExporter

    html, _resources = HTMLExporter(template_name="lab").from_notebook_node(nb)
    start = html.index('<div class="nan-magic-report nm-static"')
    static = html[start:html.index('<div class="jp-OutputArea-child', start)]  # (its own output, before the widget's)
    assert "first non-finite value in forward step 1: code outside any watched module" in static
    assert "data:image/png;base64," in static  # the histograms
    assert "Traceback" not in static and "NonFiniteError" not in static and "ipykernel_" not in static


@pytest.mark.skipif(sys.version_info < (3, 11), reason="a model's container label needs co_positions (3.11)")
def test_a_dict_of_modules_with_two_optimizers_stopped_then_deferred(tmp_path: Path) -> None:
    nb = run("dict_parts_defer.ipynb", tmp_path, {"debug": ["p z.max() > 88.72", "u", "p epoch, i", "q"]},
             interrupted={"long_run": 6})
    stopped = named_cell(nb, "long_run")
    (error,) = [output for output in stopped.outputs if output.output_type == "error"]
    assert error.ename == "KeyboardInterrupt"
    assert "nan_magic" not in cell_text(stopped)  # no frame of ours in the user's traceback
    # nothing left on the parts or the optimizers, and no weight touched by the watch
    assert printed(named_cell(nb, "after_stop")) == "[0, 0] [0, 0] True"
    train = named_cell(nb, "train")
    short = short_error(train)
    # row 77 (the glitch) is the 14th of batch 4: both optimizers step once an iteration, so step 4 is iteration 4
    # named as the loop's line takes it from the dict; was "PoissonDecoder (root) in part", the loop variable the
    # `start_over` cell left bound to the decoder
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 4: PoissonDecoder (root) in "
                         "parts['decoder']",
                         "  op aten.exp.default at Cell In[3], line 8 (8 +inf of 192)"], short
    assert short[2:4] == ["Cell In[7], line 6", "    rate = parts['decoder'](parts['encoder'](noisy))"], short
    summary = cell_text(named_cell(nb, "summary")).splitlines()
    assert summary[0] == "forward '' PoissonDecoder aten.exp.default 8 4"
    assert summary[1].startswith("exp-overflow: aten.exp.default in PoissonDecoder (root) overflowed float32 in 8 "
                                 "elements: exp(x) is inf for x > 88.72, `z` reached "), summary
    # F.softplus keeps it finite, but a rate of 1.5e4 is no healthy one: not called verified
    assert summary[2:] == ["stable True the log(1 + exp(x)) computed as F.softplus(x), where the exp overflowed"]
    text = report_text(train)
    assert "0 of 1 verified, 1 finite but off the healthy scale" in text
    assert "  first at    index (13, " in text
    debug = cell_text(named_cell(nb, "debug"))
    assert arrow_at(debug, 8, "return torch.log(1 + torch.exp(z))  # softplus: a Poisson rate must be positive"), debug
    assert "ipdb> p z.max() > 88.72\ntensor(True)\n" in debug
    assert arrow_at(debug, 6, "rate = parts['decoder'](parts['encoder'](noisy))") and "(0, 64)" in debug, debug


def test_a_full_watch_switched_off_and_on_around_an_unwatched_evaluation(tmp_path: Path) -> None:
    nb = run("stuck_sensor_full.ipynb", tmp_path)
    (usage,) = cell_text(named_cell(nb, "bad_option")).strip().splitlines()
    assert usage.startswith("UsageError: %%nantrace: unrecognized arguments: --modee; the options are --defer, "
                            "--dump, --exclude, --full,"), usage
    assert "never runs" not in cell_text(named_cell(nb, "bad_option"))
    assert printed(named_cell(nb, "watch")) == (
        "nan_magic: watching every cell (every module called; every module call checked (--full)) until %nanwatch off")
    assert printed(named_cell(nb, "epoch1")).startswith("loss ")
    assert printed(named_cell(nb, "status")) == "nan_magic: on for every cell (--full)"  # mid-run: no report yet
    assert printed(named_cell(nb, "off")) == "nan_magic: watch off"
    # the watch is off: the held-out batch with the stuck sensor prints nan, and nothing else is said
    unwatched = named_cell(nb, "unwatched")
    assert printed(unwatched) == "held-out loss nan" and [o.output_type for o in unwatched.outputs] == ["stream"]
    short = short_error(named_cell(nb, "epoch2"))
    # a new run since `%nanwatch on` again: gesture 141 is the 14th of its 9th batch, step 8
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 8: norm (FrameNorm)",
                         "  op aten.sqrt.default at Cell In[3], line 10 (1 nan of 96)"], short
    assert "producer: Cell In[3], line 10, in forward" in short
    summary = cell_text(named_cell(nb, "summary")).splitlines()
    assert summary[0] == "forward 'norm' aten.sqrt.default 10 8"
    assert summary[1] == ("sqrt-domain: sqrt got 1 negative in `var` (`self` of aten.sqrt.default in norm "
                          "(FrameNorm)): clamp to >= 0 first (x.clamp_min(0)), or compute the value so it cannot go "
                          "negative (a variance as ((x - mean)**2).mean())")
    text = report_text(named_cell(nb, "epoch2"))
    # (a forward event stops before the loss code: its trial is verified through the model only, session 46's title)
    assert "  first at    index (13, 4, 0)\n" in text and "0 of 1 verified, 1 through the model only" in text
    assert "  local var: f32[16,6,1] finite in [-3.725e-09, " in text
    assert "last report: first non-finite value in forward step 8: norm (FrameNorm)" in cell_text(
        named_cell(nb, "status_after"))
    # watch()'s mode="full" written as an option: the one line points to --full (was: the list alone)
    (usage,) = cell_text(named_cell(nb, "bad_mode")).strip().splitlines()
    assert usage.startswith("UsageError: %nanwatch: unrecognized arguments: --mode (did you mean --full? watch()'s "
                            "mode=\"full\" is --full here); the options are --defer, "), usage


def test_a_bare_nanwatch_over_a_loop_that_takes_the_logit_of_a_rate_of_one(tmp_path: Path) -> None:
    nb = run("ctr_logit_bare.ipynb", tmp_path, {"debug": ["p target.flatten()[17]", "p i", "q"]})
    train = named_cell(nb, "train")
    short = short_error(train)
    # slot 117 (3 clicks of 3 views) is the 18th of batch 4: the loop's own line made it, before the model saw it
    assert short[:4] == ["NonFiniteError: first non-finite value in data step 4: code outside any watched module",
                         "  op aten.logit.default at Cell In[4], line 3 (1 +inf of 25)",
                         "producer: Cell In[4], line 3",
                         "    target = torch.logit(ctr[i:i + 25]).unsqueeze(1)  # regress the log-odds"], short
    read = cell_text(named_cell(nb, "read")).splitlines()
    assert read[0] == "data None aten.logit.default 3 4 0 1 0 25"
    assert read[1].startswith("log-domain: logit in the code at Cell In[4], line 3 got 1 value at 0 or 1 and 0 "
                              "outside [0, 1]"), read
    # (7 rows since session 46: the producer row is the logit's own output, 1 +inf of 25, the loss it reached after)
    assert read[2].startswith("eps True ") and read[-1] == "7 rows"
    text = report_text(train)
    assert "  first at    index (17,)\n" in text and "1 of 1 verified" in text
    # Was "code outside the modules (the loss) produced it": the loss check's note, kept as the finding became data's
    assert "every watched module output of this step was finite: code outside the modules made it from the data " \
           "alone (a target or an input it built), not from a model's output" in text
    assert "(the loss) produced it" not in text
    debug = cell_text(named_cell(nb, "debug"))
    assert arrow_at(debug, 3, "target = torch.logit(ctr[i:i + 25]).unsqueeze(1)  # regress the log-odds"), debug
    assert "ipdb> p target.flatten()[17]\ntensor(inf)\n" in debug and "ipdb> p i\n100\n" in debug
    assert printed(named_cell(nb, "next_cell")) == "unwatched 6.363 0"  # a bare %nanwatch ends with its cell
