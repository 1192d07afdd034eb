"""Whole cells of the calm17 programs through a real IPython shell (issue 25): under a bare ``%%nantrace`` in
the five modes, run twice (the same cell run again), and under ``%nanwatch on`` across all of them. Bare, the
watch takes every module the cell calls at top level and every optimizer that steps, including the ones the cell
makes (an EMA by deepcopy, a scaler that is disabled, a compiled model). Asserted: no report, no error, the
cell's ``result`` bit-identical to the unwatched run, nothing of ours left on the namespace's models, optimizers
and scalers (test_calm16's ``_traces``).
"""

from __future__ import annotations

import pytest
import torch
from IPython.utils.capture import capture_output
from test_calm16 import _traces, same
from torch import nn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLAGS = ["", "--defer", "--ops", "--ops --defer", "--full"]

CELLS = {
    "nanogpt-bf16": """
import io, math, torch
from torch.nn import functional as F
from test_calm17_programs import GPT
torch.manual_seed(0)
data = torch.randint(0, 24, (200,))
model = GPT()
optimizer = model.configure_optimizers(weight_decay=0.1, lr=6e-3)
scaler = torch.amp.GradScaler("cpu", enabled=False)  # bfloat16: nanoGPT's scaler stays off
def get_batch():
    ix = torch.randint(len(data) - 8, (4,))
    return torch.stack([data[i:i + 8] for i in ix]), torch.stack([data[i + 1:i + 9] for i in ix])
@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = torch.stack([model(*get_batch())[1] for _ in range(2)])
    model.train()
    return losses.mean()
result, best_val_loss = [], 1e9
X, Y = get_batch()
for it in range(5):
    lr = 6e-3 * (it + 1) / 3 if it < 2 else 6e-4 + 0.5 * (1 + math.cos(math.pi * (it - 2) / 3)) * 5.4e-3
    for group in optimizer.param_groups:
        group["lr"] = lr
    if it % 2 == 0:
        val = estimate_loss()
        if val < best_val_loss:
            best_val_loss, ckpt = val, io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, ckpt)
        print(f"step {it}: val loss {val:.4f}")
    for micro_step in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = model(X, Y)
            loss = loss / 2
        X, Y = get_batch()
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    result.append(loss.detach().float())
model.eval()
result.append(model.generate(torch.zeros(2, 1, dtype=torch.long), 8, temperature=0.8, top_k=5))
result += [p.detach().clone() for p in model.parameters()]
""",
    "ddpm-ema-in-cell": """
import copy, torch
from torch.nn import functional as F
from test_calm17_programs import Denoiser
torch.manual_seed(0)
T = 20
betas = torch.linspace(1e-4, 0.4, T)
ac = torch.cumprod(1 - betas, 0)
net = Denoiser(T)
ema = copy.deepcopy(net).requires_grad_(False).eval()
opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
result = []
for step in range(4):
    x0 = torch.randn(16, 2)
    t = torch.randint(0, T, (16,))
    noise = torch.randn_like(x0)
    xt = ac[t].sqrt()[:, None] * x0 + (1 - ac[t]).sqrt()[:, None] * noise
    loss = F.mse_loss(net(xt, t), noise)
    opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), net.parameters()):
            pe.lerp_(p, 0.1)
    result.append(loss.detach())
with torch.no_grad():
    x = torch.randn(8, 2)
    for i in reversed(range(T)):
        eps = ema(x, torch.full((8,), i))
        x = (x - betas[i] / (1 - ac[i]).sqrt() * eps) / (1 - betas[i]).sqrt()
        if i > 0:
            x = x + betas[i].sqrt() * torch.randn_like(x)
result += [x, *(p.detach().clone() for p in ema.parameters())]
""",
    "ppo-masked": """
import torch
from torch import nn
from test_calm17_searches import ActorCritic
torch.manual_seed(0)
agent = ActorCritic()
opt = torch.optim.Adam(agent.parameters(), lr=3e-3)
result = []
for update in range(2):
    obs, legal = torch.randn(16, 6), torch.rand(16, 5) < 0.5
    legal[:, 0] = True
    with torch.no_grad():
        dist, values = agent(obs, legal)
        actions = dist.sample()
        old_logp = dist.log_prob(actions)
    rewards = (actions == 0).float()
    adv = rewards - values
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    for epoch in range(2):
        dist, v = agent(obs, legal)
        ratio = (dist.log_prob(actions) - old_logp).exp()
        loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() + 0.5 * (v - rewards).pow(2).mean() \\
            - 0.01 * dist.entropy().mean()
        opt.zero_grad(); loss.backward(); nn.utils.clip_grad_norm_(agent.parameters(), 0.5); opt.step()
        result.append(loss.detach())
""",
    "class-in-cell-plots": """
import io, torch
import matplotlib
matplotlib.use("Agg")
from matplotlib import pyplot as plt
from torch import nn
from torch.nn import functional as F
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(16, 3)
    def forward(self, x):
        return self.head(self.body(x))
torch.manual_seed(0)
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
best, history = float("inf"), []
for epoch in range(4):
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    history.append(loss.item())
    best = min(best, loss.item())
    print(f"epoch {epoch} loss {loss.item():.4f} best {best:.4f}")
fig, ax = plt.subplots()
ax.plot(history); ax.hist(net.head.weight.detach().flatten().numpy())
fig.savefig(io.BytesIO(), format="png"); plt.close(fig)
result = [torch.tensor(history), *(t.detach().clone() for t in net.state_dict().values())]
""",
}


def _run(ip, source: str):
    with capture_output() as captured:
        outcome = ip.run_cell(source)
    ip.user_ns.pop("_", None)  # (a cell's ``for _ in``: keep the shared shell's ``_`` IPython's, see test_calm16)
    return outcome, captured


HELD = (nn.Module, torch.optim.Optimizer, torch.amp.GradScaler)


def _kept(ns: dict) -> list:
    """The traces of every model, optimizer and scaler the cells left in the namespace, by name."""
    return [(name, _traces(value)) for name, value in sorted(ns.items()) if isinstance(value, HELD)]


def _forget(ip) -> None:
    """A fresh kernel's namespace, as far as the cells' torch objects go."""
    for name in [name for name, value in ip.user_ns.items() if isinstance(value, HELD)]:
        del ip.user_ns[name]


def _unwatched(ip, name: str) -> tuple[list, list]:
    outcome, captured = _run(ip, CELLS[name])
    assert outcome.error_in_exec is None, captured.stdout
    return ip.user_ns["result"], _kept(ip.user_ns)


@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("name", CELLS)
def test_a_whole_cell_under_a_bare_nantrace_run_twice_is_what_it_is_unwatched(ip, name: str, flags: str) -> None:
    expected, traces = _unwatched(ip, name)
    for _ in range(2):
        ip.user_ns.pop("_nan_report", None)
        outcome, captured = _run(ip, f"%%nantrace {flags}\n{CELLS[name]}")
        assert outcome.error_in_exec is None, captured.stdout
        # A benign event is shown, never raised (PRODUCT.md): ppo-masked's policy returns a Categorical of
        # masked_fill(-inf) logits, whose deliberate infinity the watch reads and reports as benign.
        report = ip.user_ns.get("_nan_report")
        assert (report is None or report.benign) and "NonFinite" not in captured.stdout, captured.stdout
        got = ip.user_ns["result"]
        assert len(got) == len(expected) and all(same(a, b) for a, b in zip(got, expected, strict=True))
        assert _kept(ip.user_ns) == traces


@pytest.mark.parametrize("flags", FLAGS)
def test_nanwatch_on_across_the_whole_cells_is_calm_and_identical(ip, flags: str) -> None:
    _forget(ip)
    expected = {name: _unwatched(ip, name) for name in CELLS}  # the cells one after another, unwatched
    _forget(ip)
    ip.user_ns.pop("_nan_report", None)
    try:
        ip.run_line_magic("nanwatch", f"on {flags}")
        runs = {name: (*_run(ip, CELLS[name]), ip.user_ns["result"], _kept(ip.user_ns)) for name in CELLS}
    finally:
        ip.run_line_magic("nanwatch", "off")
    for name, (outcome, captured, got, traces) in runs.items():
        assert outcome.error_in_exec is None, (name, captured.stdout)
        assert "NonFinite" not in captured.stdout, (name, captured.stdout)
        want, want_traces = expected[name]
        assert len(got) == len(want) and all(same(a, b) for a, b in zip(got, want, strict=True)), name
        assert traces == want_traces, name
    report = ip.user_ns.get("_nan_report")  # ppo-masked's masked_fill(-inf) policy logits: benign, shown
    assert report is None or report.benign
