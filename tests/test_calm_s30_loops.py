"""Healthy loop shapes under the watch (calm_s30), every mode: optimizers written in Python (Lion, Adafactor by
hand, SAM and a backtracking line search with closures), optimizer-in-backward by post-accumulate-grad hooks,
sharded optimizers without a process group, an EMA AveragedModel with update_bn, SequentialLR and
ChainedScheduler, Welford statistics kept by hand, DataLoaders (a collate_fn padding with NaN, a Generator per
loader), anomaly mode inside the watch, the whole model reinitialised, an optimizer recreated each epoch, the watch
entered twice in one cell, a KeyboardInterrupt inside the forward or the backward and then the next cell.
"""

from __future__ import annotations

import math

import pytest
import torch
from calm_s30 import MODES, Row, check, steps
from torch import nn
from torch.nn import functional as F
from torch.optim import swa_utils
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)


def _mlp(d_in: int = 6, d_out: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out))


def _data(n: int = 8, d_in: int = 6, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, d_in), torch.randint(0, classes, (n,))


def _with(opt_of, n: int = 3) -> Row:
    model = _mlp()
    opt = opt_of(model)
    x, y = _data()
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(model(x), y), n))


# -- optimizers written by the user ----------------------------------------------------------------------------


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((m * b1 + p.grad * (1 - b1)).sign_(), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - b2)
        return loss


class FactoredAdafactor(torch.optim.Optimizer):
    """Adafactor by hand: row and column second moments for matrices, relative step size, update clipping."""

    def __init__(self, params, lr: float = 1e-2, eps=(1e-30, 1e-3), clip: float = 1.0, decay: float = -0.8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps, "clip": clip, "decay": decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if not state:
                    state["step"] = 0
                    if p.dim() == 2:
                        state["row"] = torch.zeros(p.shape[0])
                        state["col"] = torch.zeros(p.shape[1])
                    else:
                        state["sq"] = torch.zeros_like(p)
                state["step"] += 1
                beta2 = 1.0 - state["step"] ** group["decay"]
                lr = min(group["lr"], 1.0 / math.sqrt(state["step"])) * max(eps2, p.pow(2).mean().sqrt().item())
                sq = g.pow(2) + eps1
                if p.dim() == 2:
                    state["row"].lerp_(sq.mean(1), 1 - beta2)
                    state["col"].lerp_(sq.mean(0), 1 - beta2)
                    r = (state["row"] / state["row"].mean()).rsqrt().unsqueeze(1)
                    update = g * r * state["col"].rsqrt().unsqueeze(0)
                else:
                    state["sq"].lerp_(sq, 1 - beta2)
                    update = g * state["sq"].rsqrt()
                update.div_((update.pow(2).mean().sqrt() / group["clip"]).clamp(min=1.0))
                p.add_(update, alpha=-lr)


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation: the closure runs twice, once at a perturbed copy of the weights."""

    def __init__(self, params, base: type, rho: float = 0.05, **kwargs) -> None:
        super().__init__(params, {"rho": rho, **kwargs})
        self.base = base(self.param_groups, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure()
        norm = torch.norm(torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"]
                                       if p.grad is not None]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                e = p.grad * (group["rho"] / (norm + 1e-12))
                self.state[p]["e"] = e
                p.add_(e)
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                if "e" in self.state[p]:
                    p.sub_(self.state[p]["e"])
        self.base.step()
        return loss


class Backtracking(torch.optim.Optimizer):
    """Gradient descent with an Armijo line search: the closure is evaluated until the loss decreases enough."""

    def __init__(self, params, lr: float = 1.0) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad.clone() for p in params]
        start = [p.clone() for p in params]
        slope = sum(g.pow(2).sum() for g in grads)
        t = self.param_groups[0]["lr"]
        for _ in range(8):
            for p, p0, g in zip(params, start, grads):
                p.copy_(p0 - t * g)
            with torch.enable_grad():
                trial = closure()
            if trial <= loss - 1e-4 * t * slope:
                break
            t *= 0.5
        return loss


def with_closure(opt_of) -> Row:
    model = _mlp()
    opt = opt_of(model)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                def closure() -> torch.Tensor:
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    return loss

                out.append(opt.step(closure).detach())
        return out

    return Row((model, opt), (model, opt), run)


def optimizer_in_backward() -> Row:
    """One Adam per parameter stepped from its post-accumulate-grad hook; the grads are freed in the hook."""
    model = _mlp()
    x, y = _data()
    opts = {p: torch.optim.Adam([p], lr=0.01) for p in model.parameters()}

    def hook(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    def run(watching) -> list[torch.Tensor]:
        handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
        out = []
        with watching(model):
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                out.append(loss.detach())
        for h in handles:
            h.remove()
        return out

    return Row((model,), (model, *opts.values()), run)


def sharded_by_hand() -> Row:
    """A ZeRO-like split without a process group: two AdamW shards over halves of the parameters, one norm."""
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    params = list(model.parameters())
    shards = [torch.optim.AdamW(params[rank::2], lr=1e-3) for rank in range(2)]
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching(model, *shards):
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                for shard in shards:
                    shard.zero_grad()
                loss.backward()
                local = [torch.stack([p.grad.pow(2).sum() for p in params[rank::2]]).sum() for rank in range(2)]
                total = torch.stack(local).sum().sqrt()
                scale = (1.0 / (total + 1e-6)).clamp(max=1.0)
                for p in params:
                    p.grad.mul_(scale)
                for shard in shards:
                    shard.step()
                out += [loss.detach(), total]
        return out

    return Row((model, *shards), (model, *shards), run)


def ema_with_update_bn() -> Row:
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    ema = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = TensorDataset(*_data(16))

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching(model, opt):
            for x, y in DataLoader(data, batch_size=8):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                ema.update_parameters(model)
                out.append(loss.detach())
            swa_utils.update_bn(DataLoader([x for x, _ in data], batch_size=8), ema)
            with torch.no_grad():
                out.append(ema(data.tensors[0]))
        return out

    return Row((model, opt), (model, ema, opt), run)


def scheduled(kind: str) -> Row:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "sequential":
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)], milestones=[2])
    else:
        sched = torch.optim.lr_scheduler.ChainedScheduler([
            torch.optim.lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)], optimizer=opt)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(5):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                out += [loss.detach(), sched.get_last_lr()[0]]
        return out

    return Row((model, opt), (model, opt), run)


# -- statistics and data -----------------------------------------------------------------------------------


def welford_by_hand() -> Row:
    """Running mean and variance of the loss and of each layer's gradient norm; the variance is NaN (0/0) at
    the first step, which the loop skips with torch.where before using it as a z-score."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        n, mean, m2, out = 0, torch.zeros(2), torch.zeros(2), []
        with watching():
            for _ in range(4):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                with torch.no_grad():
                    value = torch.stack([loss, model[0].weight.grad.norm()])
                    n += 1
                    delta = value - mean
                    mean += delta / n
                    m2 += delta * (value - mean)
                    var = m2 / torch.tensor(n - 1.0)  # (0/0 = NaN at n = 1: unbiased variance of one sample)
                    z = torch.where(torch.isfinite(var) & (var > 0), (value - mean) / var.sqrt(), torch.zeros(2))
                opt.step()
                out += [loss.detach(), z, mean.clone()]
        return out

    return Row((model, opt), (model, opt), run)


def _pad_with_nan(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(x) for x, _ in batch)
    xs = torch.full((len(batch), length, 3), float("nan"))
    for i, (x, _) in enumerate(batch):
        xs[i, :len(x)] = x
    return xs, torch.stack([y for _, y in batch])


def nan_padding_collate() -> Row:
    """Variable-length sequences padded with NaN by the collate_fn; the loop builds the mask from isnan and
    zero-fills before the model (num_workers=0)."""
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    items = [(torch.randn(n, 3), torch.randn(2)) for n in (2, 5, 3, 4, 1, 5)]

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for xs, ys in DataLoader(items, batch_size=3, collate_fn=_pad_with_nan, num_workers=0):
                present = ~xs.isnan().any(-1)
                h = model(xs.nan_to_num(0.0)) * present.unsqueeze(-1)
                pred = h.sum(1) / present.sum(1, keepdim=True)
                loss = F.mse_loss(pred, ys)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run, quiet=True)


def generator_per_loader() -> Row:
    """Two shuffling DataLoaders each with its own torch.Generator, a RandomSampler beside them, and dropout on
    the global stream: each stream's state after must be what it is unwatched."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train, extra = TensorDataset(*_data(12)), TensorDataset(*_data(6))
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(2):
                mixed = zip(DataLoader(train, batch_size=4, shuffle=True, generator=g1),
                            DataLoader(extra, batch_size=2, sampler=torch.utils.data.RandomSampler(
                                extra, generator=g2)))
                for (x, y), (x2, y2) in mixed:
                    loss = F.cross_entropy(model(torch.cat([x, x2])), torch.cat([y, y2]))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    out.append(loss.detach())
        return [*out, g1.get_state(), g2.get_state()]

    return Row((model, opt), (model, opt), run)


def clip_or_skip() -> Row:
    """clip_grad_norm_(error_if_nonfinite=False, foreach=True) on finite grads; the step is skipped if the norm is
    not finite (it never is here), the norms logged."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y) * 50
                opt.zero_grad()
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, error_if_nonfinite=False,
                                                      foreach=True)
                if torch.isfinite(norm):
                    opt.step()
                out += [loss.detach(), norm]
        return out

    return Row((model, opt), (model, opt), run, quiet=True)


# -- modes, resets, cells ------------------------------------------------------------------------------------


def anomaly_mode(where: str) -> Row:
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        if where == "set":
            with watching():
                torch.autograd.set_detect_anomaly(True)
                try:
                    for _ in range(3):
                        loss = F.cross_entropy(model(x), y)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        out.append(loss.detach())
                finally:
                    torch.autograd.set_detect_anomaly(False)
        else:
            with torch.autograd.detect_anomaly(check_nan=True), watching():
                for _ in range(3):
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run, quiet=True)


def whole_model_reinitialised() -> Row:
    """Every layer's reset_parameters() at step 2 (it draws from the RNG), with a fresh optimizer state."""
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                if step == 2:
                    for m in model.modules():
                        if hasattr(m, "reset_parameters"):
                            m.reset_parameters()
                    opt.state.clear()
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def optimizer_each_epoch() -> Row:
    """A new Adam each epoch (its learning rate from a schedule), not passed to the watch."""
    model = _mlp()
    x, y = _data()
    kept: list[torch.optim.Optimizer] = []

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching(model):
            for epoch in range(3):
                opt = torch.optim.Adam(model.parameters(), lr=0.01 / (epoch + 1))
                for _ in range(2):
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    out.append(loss.detach())
                kept[:] = [opt]
        return out

    return Row((model,), (model,), run)


def entered_twice() -> Row:
    """Two watches one after the other in one cell: training, then a fine-tune of the head with a new SGD."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    head_opt = torch.optim.SGD(model[2].parameters(), lr=0.05)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        for o in (opt, head_opt):
            with watching(model, o):
                for _ in range(2):
                    loss = F.cross_entropy(model(x), y)
                    o.zero_grad()
                    loss.backward()
                    o.step()
                    out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt, head_opt), run)


class _Interrupt:
    """Raises KeyboardInterrupt once, at the n-th call: the user pressing stop mid-forward or mid-backward."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, *args) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


def interrupted(where: str) -> Row:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        stop = _Interrupt(at=2)
        if where == "forward":
            handle = model[2].register_forward_pre_hook(lambda m, a: stop())
        else:
            handle = model[2].weight.register_hook(lambda g: stop())
        try:
            with watching():  # the first cell, stopped at its second step
                for _ in range(4):
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    out.append(loss.detach())
        except KeyboardInterrupt:
            out.append(torch.tensor(-1.0))
        handle.remove()
        with watching():  # the next cell
            for _ in range(2):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def ema_by_foreach_lerp() -> Row:
    """A shadow copy of the weights updated by torch._foreach_lerp_ after each step, evaluated each step."""
    model = _mlp()
    shadow = _mlp()
    shadow.load_state_dict(model.state_dict())
    shadow.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching(model, opt):
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    torch._foreach_lerp_(list(shadow.parameters()), list(model.parameters()), 0.1)
                    out.append(shadow(x))
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, shadow, opt), run)


ROWS = {
    "lion_written_in_python": lambda: _with(lambda m: Lion(m.parameters(), lr=1e-3, weight_decay=0.1)),
    "adafactor_builtin": lambda: _with(lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2)),
    "adafactor_by_hand_factored": lambda: _with(lambda m: FactoredAdafactor(m.parameters())),
    "sam_closure_twice": lambda: with_closure(lambda m: SAM(m.parameters(), torch.optim.SGD, lr=0.05)),
    "backtracking_line_search_closure": lambda: with_closure(lambda m: Backtracking(m.parameters())),
    "optimizer_in_backward_post_accumulate_hooks": optimizer_in_backward,
    "two_shards_by_hand_one_norm": sharded_by_hand,
    "ema_averaged_model_use_buffers_update_bn": ema_with_update_bn,
    "sequential_lr_warmup_cosine": lambda: scheduled("sequential"),
    "chained_scheduler": lambda: scheduled("chained"),
    "welford_by_hand_nan_variance_guarded": welford_by_hand,
    "collate_fn_pads_with_nan_then_masks": nan_padding_collate,
    "generator_per_dataloader": generator_per_loader,
    "clip_error_if_nonfinite_false_or_skip": clip_or_skip,
    "set_detect_anomaly_inside_the_watch": lambda: anomaly_mode("set"),
    "detect_anomaly_around_the_watch": lambda: anomaly_mode("around"),
    "whole_model_reset_parameters_mid_watch": whole_model_reinitialised,
    "optimizer_recreated_every_epoch": optimizer_each_epoch,
    "watch_entered_twice_in_one_cell": entered_twice,
    "keyboard_interrupt_mid_forward_then_next_cell": lambda: interrupted("forward"),
    "keyboard_interrupt_mid_backward_then_next_cell": lambda: interrupted("backward"),
    "ema_shadow_by_foreach_lerp": ema_by_foreach_lerp,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_loop_shapes_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)
