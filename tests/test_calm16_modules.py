"""Modules that hold or pass on an infinity on purpose stay calm in the five modes (issue 25; harness:
test_calm16.py): a submodule that builds the attention mask and returns it (-inf in a module's output, consumed
finitely by its parent), a running maximum whose buffer starts at -inf, a best-loss buffer at +inf, a model that
imputes the missing values (NaN) of its own input; ``%nanwatch on`` left on across healthy cells; whole cells
under a bare ``%%nantrace`` (a teacher and best model deep-copied in the loop, AMP whose scaler skips).
"""

from __future__ import annotations

import pytest
import torch
from IPython.utils.capture import capture_output
from test_calm16 import Loop, assert_calm, sgd_loop
from torch import nn
from watching import FIVE_MODES

NEG_INF = float("-inf")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CausalMask(nn.Module):
    """Returns the additive causal mask: 0 on and below the diagonal, -inf above (a module output with -inf)."""

    def forward(self, t: int) -> torch.Tensor:
        return torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), NEG_INF)


class MaskedBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.make_mask, self.qkv, self.out = CausalMask(), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(1, 2) / 8 ** 0.5 + self.make_mask(x.shape[1])
        return self.out(scores.softmax(-1) @ v)


class RunningMax(nn.Module):
    """Normalises by the largest activation seen so far: a buffer that starts at -inf, and a best-loss buffer at
    +inf the loop updates (early stopping state kept on the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
        self.register_buffer("peak", torch.tensor(NEG_INF))
        self.register_buffer("best", torch.tensor(float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training:
            with torch.no_grad():
                self.peak = torch.maximum(self.peak, h.abs().max())
        return self.head(h / self.peak)


def running_max() -> Loop:
    model = RunningMax()
    x = torch.randn(8, 4)
    loop = sgd_loop(model, lambda m, step: m(x).pow(2).mean())

    def run() -> list[torch.Tensor]:
        losses = loop.run()
        for loss in losses:
            model.best = torch.minimum(model.best, loss)
        return losses
    return Loop(loop.targets, loop.held, run)


class Imputing(nn.Module):
    """Takes rows with missing values (NaN) and imputes them itself: a learned fill value and a missing flag."""

    def __init__(self) -> None:
        super().__init__()
        self.fill = nn.Parameter(torch.zeros(6))
        self.net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        missing = torch.isnan(x)
        x = torch.where(missing, self.fill.expand_as(x), x)
        return self.net(torch.cat([x, missing.float()], -1))


def imputing() -> Loop:
    xs = [torch.randn(8, 6) for _ in range(3)]
    for x in xs:
        x[torch.rand(8, 6) < 0.2] = float("nan")
    return sgd_loop(Imputing(), lambda m, step: m(xs[step]).pow(2).mean())


MODULES = {
    "submodule-returns-a-causal-mask": lambda: sgd_loop(MaskedBlock(), lambda m, s: m(torch.randn(2, 5, 8)).pow(2)
                                                        .mean()),
    "buffers-starting-at-inf": running_max,
}

# A NaN entering the model that the model handles itself (imputes it before any arithmetic) is a benign event
# (PRODUCT.md "benign"; hot/kept/held_batch.py): recorded, never raised. tests/test_handled_inputs.py has the rest.
@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", [*MODULES, "model-imputes-its-nan-input"])
def test_modules_that_hold_or_pass_on_an_infinity_on_purpose_are_calm(name: str, options: dict) -> None:
    assert_calm(MODULES.get(name, imputing), options)


SETUP = """
import torch
from torch import nn
from torch.nn import functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x, y = torch.randn(6, 4), torch.randn(6, 1)
"""

CELLS = [
    "for step in range(2):\n    loss = F.mse_loss(model(x), y)\n    opt.zero_grad(); loss.backward(); opt.step()\n",
    "model.eval()\nwith torch.no_grad():\n    pred = model(x)\nmodel.train()\n",
    "best = float('inf')\nmask = torch.zeros(3, 3).masked_fill(torch.ones(3, 3).bool().triu(1), float('-inf'))\n",
    "loss = F.mse_loss(model(x), y)\nopt.zero_grad(); loss.backward(); opt.step()\nbest = min(best, loss.item())\n",
]


@pytest.mark.parametrize("flags", ["", "--defer", "--ops", "--ops --defer", "--full"])
def test_nanwatch_on_across_healthy_cells_is_calm_and_identical(ip, flags: str) -> None:
    ip.run_cell(SETUP)
    for cell in CELLS:
        assert ip.run_cell(cell).error_in_exec is None
    expected = [p.detach().clone() for p in ip.user_ns["model"].parameters()]
    ip.run_cell(SETUP)
    ip.user_ns.pop("_nan_report", None)
    with capture_output() as captured:
        ip.run_line_magic("nanwatch", f"on {flags}")
        results = [ip.run_cell(cell) for cell in CELLS]
        ip.run_line_magic("nanwatch", "off")
    assert all(r.error_in_exec is None for r in results), captured.stdout
    assert ip.user_ns.get("_nan_report") is None and "NonFinite" not in captured.stdout
    got = [p.detach() for p in ip.user_ns["model"].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert not ip.user_ns["model"]._forward_hooks and not ip.user_ns["model"][0]._forward_hooks


#: Whole cells as a checker writes them, run under a bare ``%%nantrace`` (every module, optimizer and scaler the
#: cell uses, created in it or not): a teacher and the best model deep-copied in the loop; AMP whose scaler skips.
WHOLE_CELLS = {
"copies": """
import copy, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x = torch.randn(8, 4)
teacher = copy.deepcopy(model).eval()
best, best_loss = None, float('inf')
for step in range(4):
    with torch.no_grad():
        target = teacher(x)
    loss = (model(x) - target).pow(2).mean() + model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad():
        for t, s in zip(teacher.parameters(), model.parameters()):
            t.lerp_(s, 0.1)
    if loss.item() < best_loss:
        best_loss, best = loss.item(), copy.deepcopy(model)
result = [p.detach().clone() for m in (model, teacher, best) for p in m.parameters()]
""",
"amp": """
import torch
from torch import nn
from torch.nn import functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
for _ in range(4):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad(); scaler.scale(loss).backward(); scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); scaler.step(opt); scaler.update()
result = [p.detach().clone() for p in model.parameters()] + [torch.tensor(scaler.get_scale())]
""",
}


@pytest.mark.parametrize("flags", ["", "--defer", "--ops", "--ops --defer", "--full"])
@pytest.mark.parametrize("name", ["copies", "amp"])
def test_whole_cells_under_a_bare_nantrace_run_as_unwatched(ip, name: str, flags: str) -> None:
    cell = WHOLE_CELLS[name]
    try:
        assert ip.run_cell(cell).error_in_exec is None
        expected = ip.user_ns["result"]
        ip.user_ns.pop("_nan_report", None)
        with capture_output() as captured:
            result = ip.run_cell(f"%%nantrace {flags}\n{cell}")
    finally:
        # The cells' own ``for _ in ...`` makes ``_`` the user's, and IPython stops updating it in the shared
        # shell: test_magics reads it later in the same process.
        ip.user_ns.pop("_", None)
    assert result.error_in_exec is None and "NonFinite" not in captured.stdout
    got = ip.user_ns["result"]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    report = ip.user_ns.get("_nan_report")
    if name == "amp":  # the scaler's skipped steps: recorded and shown (the report displayed), never raised
        assert report is not None and report.benign
    else:
        assert report is None
