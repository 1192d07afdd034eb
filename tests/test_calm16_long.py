"""Longer healthy runs, where a watch's later-step paths run (its second step, the update region watched from
step 1, the recorders' budgets), in the five modes (issue 25; harness: test_calm16.py): 25 steps of masked
attention with dropout and a batch length that changes every step; a GradScaler that overflows and backs off again
and again (growth_interval=1) on a model with dropout (a skipped step must not move the generators: the outputs
after it stay bit-identical); gradient accumulation under a GradScaler whose skip falls on an accumulated step;
random draws in the loop's code (a shuffling DataLoader, noise, sample dropping, a permutation), the generator's
state compared after.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_calm16 import Loop, assert_calm
from torch import nn
from torch.nn import functional as F
from watching import FIVE_MODES

NEG_INF = float("-inf")
STEPS = 25

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class DropoutAttention(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv, self.out, self.drop = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Dropout(0.1)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = (q @ k.transpose(1, 2) / 8 ** 0.5).masked_fill(~(causal & keep[:, None, :]), NEG_INF)
        return x + self.out(self.drop(scores.softmax(-1)) @ v)


def variable_lengths() -> Loop:
    model = DropoutAttention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    lengths = [3 + step % 5 for step in range(STEPS)]
    batches = []
    for t in lengths:
        keep = torch.ones(3, t, dtype=torch.bool)
        keep[1, t // 2 + 1:] = False  # right padding; every row keeps its first key
        batches.append((torch.randn(3, t, 8), keep))

    def run() -> list[torch.Tensor]:
        out = []
        for x, keep in batches:
            loss = model(x, keep).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            out.append(loss.detach())
        return out
    return Loop((model, opt), (model, opt), run)


def scaler_cycles(accumulate: int = 1) -> Loop:
    """fp16 autocast, GradScaler(growth_interval=1): the scale doubles each step until the fp16 gradients
    overflow, then halves: a skipped step every few steps, with dropout drawing in every forward."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=1)
    data = [(torch.randn(16, 16), torch.randint(0, 4, (16,))) for _ in range(accumulate)]

    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(STEPS):
            opt.zero_grad()
            for x, y in data:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y) / accumulate
                scaler.scale(loss).backward()
                out.append(loss.detach())
            scaler.step(opt)
            scaler.update()
            out.append(torch.tensor(scaler.get_scale()))
        return out
    return Loop((model, opt, scaler), (model, opt, scaler), run)


def random_loop_code() -> Loop:
    """Two epochs of a shuffling DataLoader on the global generator, noise, sample dropping and a permutation
    drawn in the loop, dropout in the model: the generator's state after the loop is one of the outputs."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ds = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randint(0, 2, (40,)))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)

    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(2):
            for x, y in loader:
                x = x + 0.1 * torch.randn_like(x)
                keep = torch.rand(x.shape[0]) > 0.2
                perm = torch.randperm(x.shape[0])
                loss = F.cross_entropy(model(x[perm]), y[perm], reduction="none")[keep].mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return [*out, torch.rand(3)]
    return Loop((model, opt), (model, opt), run)


LONG = {
    "random-draws-in-the-loop-code": random_loop_code,
    "masked-attention-dropout-variable-lengths": variable_lengths,
    "scaler-overflow-cycles-with-dropout": scaler_cycles,
    "scaler-cycles-with-accumulation": lambda: scaler_cycles(accumulate=3),
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", LONG)
def test_longer_healthy_runs_are_calm(name: str, options: dict) -> None:
    w = assert_calm(LONG[name], options)
    if name.startswith("scaler"):
        assert sum(event.benign for event in w.events) >= 2, w.events  # it really skipped, more than once


def test_the_scale_really_cycles() -> None:
    torch.manual_seed(0)
    scales = [float(t) for t in scaler_cycles().run()[1::2]]
    drops = sum(b < a for a, b in itertools.pairwise(scales))
    assert drops >= 2, scales
