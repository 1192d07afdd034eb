"""What a person sees in a real kernel, on cases the demo notebooks do not have.

One notebook, executed once by nbclient (a real ipykernel), asserted per
cell: a training loop split over cells (model, loss helper, loop), immediate
and ``--defer``; a batch standardised by a zero std; a learning rate that
blows the model up; ``--warn``; a cell that raises an ordinary error. Each
assertion reads what the user reads: the error line, the static report's
text, the warning on stderr, the next cell's view of ``sys.last_traceback``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from jupyter_support import execute_cells, named_cell

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

#: The training loop that fails at step 3 in the loss helper (the deferred one runs it with --defer).
LOOP = (
    "%%nantrace\n"
    "for step in range(5):\n"
    "    logits = model(xs)\n"
    "    loss = my_loss(logits, ys) if step == 3 else nn.functional.cross_entropy(logits, ys)\n"
    "    opt.zero_grad()\n"
    "    loss.backward()\n"
    "    opt.step()"
)
CELLS = {
    "setup": (
        "%load_ext nan_magic\n"
        "import sys, warnings\n"
        "import torch\n"
        "from torch import nn\n"
        "warnings.simplefilter('always')"
    ),
    "model": (
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))\n"
        "\n"
        "    def forward(self, x):\n"
        "        return self.body(x)\n"
        "\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    model = Net()\n"
        "    return model, torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model, opt = build()\n"
        "xs, ys = torch.randn(8, 4), torch.randint(0, 3, (8,))"
    ),
    "loss_helper": (
        "def my_loss(logits, y):\n"
        "    probs = (logits * 300).softmax(-1)  # sharp: some probabilities are exactly 0\n"
        "    picked = probs[torch.arange(len(y)), y]\n"
        "    return -picked.log().mean()"
    ),
    "loop": LOOP,
    "loop_report": "print(_nan_report.phase, _nan_report.module, _nan_report.op, _nan_report.step)",
    "rebuild": "model, opt = build()",
    "deferred_loop": LOOP.replace("%%nantrace\n", "%%nantrace --defer\n"),
    "deferred_report": "print(_nan_report.phase, _nan_report.module, _nan_report.op, _nan_report.step)",
    "zero_std_data": (
        "torch.manual_seed(0)\n"
        "raw = torch.randn(64, 5)\n"
        "raw[:, 2] = 3.0  # a constant feature: its std is 0\n"
        "mean, std = raw.mean(0), raw.std(0)\n"
        "reg = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))\n"
        "reg_opt = torch.optim.SGD(reg.parameters(), lr=0.01)\n"
        "target = torch.randn(64, 1)"
    ),
    "zero_std": (
        "%%nantrace\n"
        "for step in range(3):\n"
        "    xb = (raw - mean) / std\n"
        "    loss = nn.functional.mse_loss(reg(xb), target)\n"
        "    reg_opt.zero_grad(); loss.backward(); reg_opt.step()"
    ),
    "zero_std_report": "print(_nan_report.cause.label, _nan_report.inputs_finite)",
    "big_lr_setup": (
        "torch.manual_seed(0)\n"
        "net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))\n"
        "big = torch.optim.SGD(net.parameters(), lr=1e10)\n"
        "bx, by = torch.randn(32, 10), torch.randn(32, 1)"
    ),
    "big_lr": (
        "%%nantrace\n"
        "for step in range(20):\n"
        "    loss = nn.functional.mse_loss(net(bx), by)\n"
        "    big.zero_grad(); loss.backward(); big.step()"
    ),
    "warn": "%%nantrace --warn\nlin = nn.Linear(3, 2)\nz = lin(torch.full((1, 3), float('inf')))\nprint('went on')",
    "own_error": "%%nantrace\ny = model(xs)\nraise ValueError('my own bug')",
    "after_own_error": (
        "print(type(sys.last_value).__name__, sys.last_value)\n"
        "print(all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules()))"
    ),
    "nanwatch_maybe": "%nanwatch maybe",
    "status_after_maybe": "%nanwatch status",
}
RAISING = {"loop", "deferred_loop", "zero_std", "big_lr", "own_error", "nanwatch_maybe"}


@pytest.fixture(scope="module")
def nb(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return execute_cells(CELLS, RAISING, tmp_path_factory.mktemp("nb27") / "nb27.ipynb")


named = named_cell


def stream(cell: Any, name: str = "stdout") -> str:
    return "".join(out["text"] for out in cell.outputs if out.output_type == "stream" and out["name"] == name)


def errors_of(cell: Any) -> list[Any]:
    return [out for out in cell.outputs if out.output_type == "error"]


def report_text(cell: Any) -> str:
    """The static report's text (what a terminal, or a frontend without widgets, shows)."""
    (text,) = [
        out["data"]["text/plain"] for out in cell.outputs
        if "nan-magic-report nm-static" in out.get("data", {}).get("text/html", "")
    ]
    return str(text)


def report_line(text: str, key: str) -> str:
    """The report's ``key`` row (``inputs``, ``op``), its key cut off."""
    (line,) = [line for line in text.splitlines() if line.startswith(f"  {key} ")]
    return line[len(key) + 2:].strip()


def test_a_loop_split_over_cells_names_the_helpers_cell_and_line(nb: Any) -> None:
    helper = named(nb, "loss_helper").execution_count
    (error,) = errors_of(named(nb, "loop"))
    assert error.evalue.startswith("first non-finite value in forward step 3: code outside any watched module"), \
        error.evalue
    assert f"at Cell In[{helper}], line 4" in error.evalue
    assert stream(named(nb, "loop_report")).split() == ["forward", "None", "aten.log.default", "3"]
    text = report_text(named(nb, "loop"))
    assert f"%debug opens in Cell In[{helper}], line 4, in my_loss" in text
    assert "local picked: f32[8]" in text


@pytest.mark.parametrize("name", ["loop", "deferred_loop"])
def test_a_log_of_zero_in_the_loss_helper_gets_a_verified_eps_fix(nb: Any, name: str) -> None:
    """The loss code is outside every module: its eps trial runs on its recorded ops, at the helper's line."""
    helper = named(nb, "loss_helper").execution_count
    text = report_text(named(nb, name))
    assert "Fixes tried on a replay of step 3" in text and "verified" in text, text
    (trial,) = [line for line in text.splitlines() if line.startswith("  eps: ")]
    assert "the operand of log clamped to at least 1.19e-7" in trial and "-> verified: the step came out finite" \
        in trial, trial
    assert (f"suggested edit (not applied): Cell In[{helper}], line 4: return -picked.clamp_min(1.2e-07).log().mean()"
            in text)


def test_the_deferred_check_names_the_same_producer(nb: Any) -> None:
    helper = named(nb, "loss_helper").execution_count
    (error,) = errors_of(named(nb, "deferred_loop"))
    assert f"forward step 3: code outside any watched module, op aten.log.default at Cell In[{helper}], line 4" \
        in error.evalue
    assert stream(named(nb, "deferred_report")).split() == ["forward", "None", "aten.log.default", "3"]


def test_a_gradient_the_deferred_check_left_unjudged_is_no_ok_row(nb: Any) -> None:
    """The deferred check stops at the loss; the NaN gradient after it carried it on, it is not "ok"."""
    text = report_text(named(nb, "deferred_loop"))
    (row,) = [line for line in text.splitlines() if "grad of model output" in line]
    assert " propagated " in row and " ok " not in row, row


def test_a_standardisation_by_a_zero_std_is_a_division_by_zero_in_the_loop(nb: Any) -> None:
    cell = named(nb, "zero_std")
    (error,) = errors_of(cell)
    assert f"op aten.div.Tensor at Cell In[{cell.execution_count}], line 3" in error.evalue
    assert stream(named(nb, "zero_std_report")).split() == ["division-by-zero", "True"]
    text = report_text(cell)
    # The division ran in the loop's code, not in the model the batch entered; its operands were finite.
    assert (f"Likely cause: division-by-zero. aten.div.Tensor in the code at Cell In[{cell.execution_count}], line 3 "
            "divided by zero") in text
    assert report_line(text, "inputs") == "finite"
    assert "std (other): f32[5] finite in [0, " in text
    assert "already non-finite" not in text


def test_a_learning_rate_blow_up_is_the_learning_rate_and_the_overflow_of_the_losss_square(nb: Any) -> None:
    cell = named(nb, "big_lr")
    (error,) = errors_of(cell)
    assert "first non-finite loss in forward step 2" in error.evalue
    text = report_text(cell)
    # Two steps suffice to see the explosion (diagnose.EXPLOSION_FACTOR); how it overflowed is the evidence.
    assert "Likely cause: learning-rate-too-high." in text and "lower the learning rate" in text, text
    assert "then: overflow: loss of aten.mse_loss.default" in text, text
    # The loss's operand is the model's output, as written, not the module path the function was called by (a call
    # of the user's model by a bare name runs no op at this line: its ops are the model's).
    assert "net(bx) (self): f32[32,1]" in text and "nn.functional (self)" not in text, text


def test_debug_locals_of_a_cells_top_level_are_the_ones_the_cell_names(nb: Any) -> None:
    cell = named(nb, "big_lr")
    text = report_text(cell)
    assert f"%debug opens in Cell In[{cell.execution_count}], line 3" in text
    shown = re.findall(r"^  local (\w+):", text, flags=re.M)
    assert set(shown) == {"bx", "by", "loss"}, shown  # not raw, std, xs, logits... of the other cells


def test_warn_mode_warns_at_the_users_line(nb: Any) -> None:
    cell = named(nb, "warn")
    assert not errors_of(cell) and "went on" in stream(cell)
    warned = stream(cell, "stderr")
    assert "RuntimeWarning: first non-finite input[0] in data step 0" in warned
    assert "nan_magic" not in warned.split("RuntimeWarning")[0], warned
    # Named as the report and IPython's tracebacks name the line, not by the kernel's temporary file (round 21).
    assert warned.startswith(f"Cell In[{cell.execution_count}], line 3: RuntimeWarning"), warned
    assert "z = lin(torch.full((1, 3), float('inf')))" in warned, warned


def test_the_users_own_error_is_theirs_and_leaves_nothing_attached(nb: Any) -> None:
    (error,) = errors_of(named(nb, "own_error"))
    assert (error.ename, error.evalue) == ("ValueError", "my own bug")
    assert stream(named(nb, "after_own_error")).splitlines() == ["ValueError my own bug", "True"]


def test_a_mistyped_nanwatch_subcommand_says_what_it_takes_and_arms_nothing(nb: Any) -> None:
    cell = named(nb, "nanwatch_maybe")
    assert not errors_of(cell) and not stream(cell)
    assert stream(cell, "stderr").strip() == (
        "UsageError: %nanwatch: 'maybe' is not on, off or status, nor a name defined here "
        "(the models, optimizers or GradScalers to watch)"
    )
    assert stream(named(nb, "status_after_maybe")).splitlines()[0] == "nan_magic: off"
