"""No false alarm on the healthy idioms an outside checker would try (issue 25: nothing may get worse), five modes.

Each idiom is a small training loop a user writes (model, loss, optimizer, a few steps), built from a seed and run
twice: unwatched, then under ``watch`` in each of the five modes. Asserted: no report, no exception, only benign
events (a GradScaler's skipped step, a deliberate -inf mask), the outputs, parameters, gradients, buffers, optimizer
and scaler state bit-identical, and nothing of ours left on the model, the optimizers or the scaler afterwards.
This file: the harness, AMP (GradScaler skips, unscale_ + clip, bf16, a scale that grows until it overflows) and
intentional non-finite values (-inf masks, inf as a start, finfo.min, nan_to_num, where-guarded logs, ignore_index,
distributions outside their support). Each family has a broken twin that must still name the right place.
test_calm16_loops.py: loop shapes; test_calm16_cells.py: what a notebook does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from watching import FIVE_MODES, raised

import nan_magic

NEG_INF = float("-inf")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)


@dataclass
class Loop:
    """What a cell holds: ``targets`` to watch (models, optimizers, a scaler), the objects whose state the loop
    changes (``held``: compared after the run, and checked for leftovers), and ``run()`` giving its outputs."""

    targets: tuple
    held: tuple
    run: Callable[[], list[torch.Tensor]]


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Everything a user could compare after the loop: parameters, gradients, buffers, optimizer and scaler state."""
    if isinstance(obj, nn.Module):
        found = []
        for p in obj.parameters():
            found += [p.detach().clone(), torch.empty(0) if p.grad is None else _dense(p.grad).clone()]
        return found + [b.clone() for b in obj.buffers()]
    if isinstance(obj, torch.optim.Optimizer):
        found = []
        for state in obj.state_dict()["state"].values():
            found += [v.clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in state.values()
                      if isinstance(v, (torch.Tensor, int, float))]
        return found + [torch.tensor(float(g["lr"])) for g in obj.param_groups]
    if isinstance(obj, torch.amp.GradScaler):
        # (a disabled scaler, nanoGPT's under bf16 and fp32, never makes its growth tracker)
        return [torch.tensor(obj.get_scale()), torch.tensor(float(getattr(obj, "_growth_tracker", None) is None
                                                                    or obj._get_growth_tracker()))]
    return []


def _traces(obj: Any) -> list[Any]:
    """What a watch could leave behind: hooks, instance attributes (a patched method is one), per module and
    parameter; an optimizer's or scaler's instance attributes and hooks."""
    if isinstance(obj, nn.Module):
        found: list[Any] = []
        for name, m in obj.named_modules():
            found.append((name, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                          len(m._backward_pre_hooks), len(m._state_dict_hooks), sorted(vars(m)),
                          vars(m).get("forward")))
        for name, p in obj.named_parameters():
            found.append((name, len(p._backward_hooks or {}), type(p), p.requires_grad))
        return found
    if isinstance(obj, torch.optim.Optimizer):
        return [sorted(vars(obj)), len(obj._optimizer_step_pre_hooks), len(obj._optimizer_step_post_hooks)]
    return [sorted(vars(obj))]


def _methods(obj: Any) -> list[Any]:
    """The instance's own callables (a scheduler's wrapper of ``opt.step``, a user's patch): the same objects after."""
    return [(name, value) for name, value in vars(obj).items() if callable(value) and not isinstance(value, nn.Module)]


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = _dense(got), _dense(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if not (got.is_floating_point() or got.is_complex()):
        return torch.equal(got, want)
    return bool(((got == want) | (got.isnan() & want.isnan())).all())


def assert_calm(build: Callable[[], Loop], options: dict) -> nan_magic.Watch:
    """Unwatched and watched runs of ``build()`` (seeded here) are identical; only benign events, no leftovers."""
    torch.manual_seed(0)
    loop = build()
    expected = loop.run() + [t for obj in loop.held for t in _tensors(obj)]
    expected_traces = [_traces(obj) for obj in loop.held]  # (after the run: a scheduler marks its optimizer)
    torch.manual_seed(0)
    loop = build()
    methods = [_methods(obj) for obj in loop.held]
    with nan_magic.watch(*loop.targets, **options) as w:
        outputs = loop.run()
    got = outputs + [t for obj in loop.held for t in _tensors(obj)]
    assert w.report is None and all(event.benign for event in w.events), (w.report, w.events)
    assert [_traces(obj) for obj in loop.held] == expected_traces
    assert [_methods(obj) for obj in loop.held] == methods
    assert len(got) == len(expected)
    assert all(same(a, b) for a, b in zip(got, expected, strict=True))
    return w


def sgd_loop(model: nn.Module, loss_of: Callable[[nn.Module, int], torch.Tensor], steps: int = 3,
             lr: float = 0.05) -> Loop:
    """``steps`` SGD(momentum) steps of ``loss_of(model, step)``; outputs: the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(steps):
            loss = loss_of(model, step)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Loop((model, opt), (model, opt), run)


# ---------------------------------------------------------------- AMP


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def amp_loop(init_scale: float, steps: int, clip: bool = False, growth_interval: int = 2000,
             pass_scaler: bool = True) -> Callable[[], Loop]:
    """float16 autocast on CPU with a GradScaler: ``init_scale`` 2**40 overflows the fp16 gradients on purpose
    (the scaler skips those steps and backs off: its normal work); ``clip``: ``unscale_`` then
    ``clip_grad_norm_``; ``growth_interval=1``: the scale doubles every step until it overflows, then halves."""
    def build() -> Loop:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))

        def run() -> list[torch.Tensor]:
            losses = []
            for _ in range(steps):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                if clip:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                losses += [loss.detach(), torch.tensor(scaler.get_scale())]
            return losses
        return Loop((model, opt, scaler) if pass_scaler else (model, opt), (model, opt, scaler), run)
    return build


def bf16_loop() -> Loop:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))  # linear warmup

    def run() -> list[torch.Tensor]:
        losses = []
        for _ in range(4):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
        return losses
    return Loop((model, opt), (model, opt), run)


AMP = {
    "fp16-scaler-skips": amp_loop(2.0 ** 40, 4),
    "fp16-scaler-skips-unpassed": amp_loop(2.0 ** 40, 4, pass_scaler=False),
    "fp16-unscale-clip-skips": amp_loop(2.0 ** 40, 4, clip=True),
    "fp16-unscale-clip": amp_loop(2.0 ** 8, 3, clip=True),
    "fp16-scale-grows-until-overflow": amp_loop(2.0 ** 12, 40, growth_interval=1),
    "bf16-autocast-warmup": bf16_loop,
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", AMP)
def test_amp_idioms_are_calm(name: str, options: dict) -> None:
    w = assert_calm(AMP[name], options)
    if "skips" in name or "overflow" in name:  # the scaler really skipped: the test would be moot otherwise
        assert any(event.benign for event in w.events), w.events


def test_the_growing_scale_really_overflows_and_backs_off() -> None:
    torch.manual_seed(0)
    loop = AMP["fp16-scale-grows-until-overflow"]()
    scales = [float(t) for t in loop.run()[1::2]]
    assert any(b < a for a, b in itertools.pairwise(scales)) and max(scales) > 2.0 ** 12


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_nan_in_the_forward_under_a_scaler_is_named_not_skipped_as_benign(options: dict) -> None:
    # Broken twin: a log of a negative activation under fp16 autocast. The scaler would skip every step
    # (the gradients are NaN); the forward NaN is a producer, not the scaler's work.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))

    def run() -> None:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).log(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    report = raised(run, model, opt, scaler, **options)
    assert (report.phase, report.module, report.step, report.benign) == ("forward", None, 0, False)
    assert report.op == "aten.log.default" and report.source is not None
    assert report.source.line.strip().startswith("loss = F.cross_entropy(model(x).log(), y)")
