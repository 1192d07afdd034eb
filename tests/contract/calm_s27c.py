"""Healthy loops the deferred mode and a long-lived watch meet, silent in every mode, the run left as unwatched.

What a watch left on for a whole training run sees step after step: a model switched between eval() and train()
every step (dropout, BatchNorm), inference under no_grad between steps, accumulation over a varying count of
micro-batches (optimizer.step() skipped on the others), two backwards a step, a model that grows a layer with its
own optimizer group, one batch tensor written in place every step, a GAN's two models with one optimizer each, a
mean teacher that is the model itself, two optimizers over one model, and a run of many short steps. The harness is
calm26.py's; the long runs (memory held over 2,000 steps, a watch left and entered again, ``%nanwatch on`` over
many cells) are in tests/test_calm_s27c_long.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Scenario
from contract.calm26 import finish


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 2))


def _data(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 2, (n,), generator=g)


def _eval_train_every_step() -> Scenario:
    """Validation under no_grad in eval() before every training step in train(): BatchNorm's running stats read."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    (x, y), (vx, vy) = _data(), _data(seed=2)

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(6):
            model.eval()
            with torch.no_grad():
                losses.append(F.cross_entropy(model(vx), vy))
            model.train()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _eval_with_grad_every_step() -> Scenario:
    """Validation in eval() without no_grad (the graph built and dropped, its loss only read with item())."""
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    (x, y), (vx, vy) = _data(), _data(seed=2)

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(5):
            model.train()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.eval()
            losses += [loss.detach(), torch.tensor(F.cross_entropy(model(vx), vy).item())]
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _accumulate_varying() -> Scenario:
    """Accumulation over 1, 3, 2, 4 micro-batches: optimizer.step() skipped on the others, loss scaled by count."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = [_data(4, seed) for seed in range(10)]

    def run() -> tuple[Any, ...]:
        losses, it = [], iter(batches)
        for count in (1, 3, 2, 4):
            for _ in range(count):
                x, y = next(it)
                loss = F.cross_entropy(model(x), y) / count
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _skip_step_on_some() -> Scenario:
    """optimizer.step() skipped every third step (a gate on the loss): the gradients zeroed anyway."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = [_data(8, seed) for seed in range(6)]

    def run() -> tuple[Any, ...]:
        losses = []
        for step, (x, y) in enumerate(batches):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            if step % 3 != 1:
                opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _two_backwards_one_graph() -> Scenario:
    """Two losses on one forward: the first backward with retain_graph=True, the second frees the graph."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(4):
            out = model(x)
            ce, reg = F.cross_entropy(out, y), out.pow(2).mean() * 0.1
            opt.zero_grad()
            ce.backward(retain_graph=True)
            reg.backward()
            opt.step()
            losses += [ce.detach(), reg.detach()]
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _two_backwards_two_forwards() -> Scenario:
    """Two forwards and two backwards a step (a clean and a noisy batch), one optimizer step after both."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _data()
    noise = torch.randn(8, 6, generator=torch.Generator().manual_seed(3)) * 0.1

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(4):
            opt.zero_grad()
            clean = F.cross_entropy(model(x), y)
            clean.backward()
            noisy = F.cross_entropy(model(x + noise), y)
            noisy.backward()
            opt.step()
            losses += [clean.detach(), noisy.detach()]
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


class _Growing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.blocks = nn.ModuleList()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _progressive_growing() -> Scenario:
    """A block added at steps 2 and 4, each with its own optimizer group (add_param_group, its own rate)."""
    torch.manual_seed(0)
    model = _Growing()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _data()

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(6):
            if step in (2, 4):
                block = nn.Linear(8, 8)
                nn.init.zeros_(block.weight)
                model.blocks.append(block)
                opt.add_param_group({"params": block.parameters(), "lr": 5e-3})
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _inference_between_steps() -> Scenario:
    """Batches of inference under no_grad (and inference_mode) in train() between training steps."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _data()
    queries = [_data(3, seed)[0] for seed in range(20, 26)]

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(6):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            model.eval()
            with torch.inference_mode() if step % 2 else torch.no_grad():
                losses.append(model(queries[step]).softmax(-1).clone())
            model.train()
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _one_batch_written_in_place() -> Scenario:
    """One batch tensor (a staging buffer) written with copy_ every step: the same object each step, new values."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    source = [_data(8, seed) for seed in range(6)]
    xb, yb = torch.empty(8, 6), torch.empty(8, dtype=torch.long)

    def run() -> tuple[Any, ...]:
        losses = []
        for x, y in source:
            xb.copy_(x, non_blocking=True)
            yb.copy_(y)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _gan(freeze: bool) -> Scenario:
    """A GAN: the discriminator's step on real and detached fakes, then the generator's through D (frozen or not)."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(3, 8), nn.LeakyReLU(0.2), nn.Linear(8, 6), nn.Tanh())
    disc = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Dropout(0.2), nn.Linear(8, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-3, betas=(0.5, 0.999))
    real = torch.randn(8, 6, generator=torch.Generator().manual_seed(4)).tanh()
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(5):
            fake = gen(torch.randn(8, 3))
            d_loss = bce(disc(real), ones) + bce(disc(fake.detach()), zeros)
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            if freeze:
                disc.requires_grad_(False)
            g_loss = bce(disc(fake), ones)
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            if freeze:
                disc.requires_grad_(True)
            losses += [d_loss.detach(), g_loss.detach()]
        return finish(losses, gen, disc, opt_g, opt_d)

    return Scenario((gen, disc, opt_g, opt_d), run)


def _mean_teacher_same_model() -> Scenario:
    """One model in eval() under no_grad for its own targets, then in train() for the loss, within one step."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, _ = _data()

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(5):
            model.eval()
            with torch.no_grad():
                target = model(x).softmax(-1)
            model.train()
            loss = F.kl_div(model(x + 0.05).log_softmax(-1), target, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _two_optimizers_one_model() -> Scenario:
    """One model's body and head under two optimizers, the head's stepped every step, the body's every other."""
    model = _net()
    body, head = list(model[:4].parameters()), list(model[4].parameters())
    opt_body = torch.optim.SGD(body, lr=0.05, momentum=0.9)
    opt_head = torch.optim.Adam(head, lr=1e-2)
    x, y = _data()

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(6):
            loss = F.cross_entropy(model(x), y)
            model.zero_grad()
            loss.backward()
            opt_head.step()
            if step % 2 == 0:
                opt_body.step()
            losses.append(loss.detach())
        return finish(losses, model, opt_body, opt_head)

    return Scenario((model, opt_body, opt_head), run)


def _many_short_steps() -> Scenario:
    """300 short steps of a tiny model: the watch's per-step work must not pile up into a false alarm."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(5))

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(300):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


ROWS = {
    "eval-train-every-step": _eval_train_every_step, "eval-with-grad-every-step": _eval_with_grad_every_step,
    "accumulate-varying-count": _accumulate_varying, "skip-step-on-some": _skip_step_on_some,
    "two-backwards-one-graph": _two_backwards_one_graph, "two-backwards-two-forwards": _two_backwards_two_forwards,
    "progressive-growing": _progressive_growing, "inference-between-steps": _inference_between_steps,
    "one-batch-written-in-place": _one_batch_written_in_place, "gan": lambda: _gan(False),
    "gan-discriminator-frozen": lambda: _gan(True), "many-short-steps": _many_short_steps,
    "mean-teacher-same-model": _mean_teacher_same_model, "two-optimizers-one-model": _two_optimizers_one_model,
}

CASES = [Case(f"calm_s27c_{name}", build, None, benign=0) for name, build in ROWS.items()]
