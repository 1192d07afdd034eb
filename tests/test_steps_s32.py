"""Two optimizers in one loop, whatever their order (session 32): the report's step is the loop's counter.

Before: an optimizer stepping every k-th iteration beside one stepping each iteration cost one iteration's lag
("step 1" at the loop's step 2), two when it stepped first in its iteration; a WGAN's critic loop (n_critic steps
before each generator step) counted every critic step ("step 15" at the loop's step 3, n_critic = 5); a body
optimizer joining after a warmup, passed to the watch, cost a lag at iteration 1. Now steps with no backward between
them are one iteration's, and a critic stepping in an inner loop of the generator's is inner (iterations.py). Each
case fails at several iterations, the optimizers passed to the watch or not, and asserts the step the loop says.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError

MODES = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"}, "ops": {"ops": True},
         "ops-defer": {"ops": True, "defer": True}}
STEPS = 13
Loop = Callable[[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, int], int]


def _occasional(k: int, first: bool) -> Loop:
    """The head's optimizer steps each iteration, the body's every k-th (``first``: before the head's)."""
    def loop(body: nn.Module, head: nn.Module, body_opt: torch.optim.Optimizer, head_opt: torch.optim.Optimizer,
             bad: int) -> int:
        for step in range(STEPS):
            loss = head(body(torch.randn(4, 8) * (float("nan") if step == bad else 1.0))).pow(2).mean()
            head_opt.zero_grad()
            loss.backward()
            if first and step % k == 0:
                body_opt.step()
                body_opt.zero_grad()
            head_opt.step()
            if not first and step % k == 0:
                body_opt.step()
                body_opt.zero_grad()
        return step
    return loop


def _critic(n_critic: int) -> Loop:
    """WGAN: the critic (``head``) steps n_critic times on detached fakes, then the generator (``body``) once."""
    def loop(gen: nn.Module, critic: nn.Module, gen_opt: torch.optim.Optimizer, critic_opt: torch.optim.Optimizer,
             bad: int) -> int:
        for step in range(STEPS):
            for _ in range(n_critic):
                loss_c = critic(gen(torch.randn(4, 8)).detach()).mean() - critic(torch.randn(4, 8)).mean()
                critic_opt.zero_grad()
                loss_c.backward()
                critic_opt.step()
            loss_g = -critic(gen(torch.randn(4, 8) * (float("nan") if step == bad else 1.0))).mean()
            gen_opt.zero_grad()
            loss_g.backward()
            gen_opt.step()
        return step
    return loop


def _both(body_first: bool, warmup: int = 0) -> Loop:
    """Both optimizers step after one backward, in either order; the body's only from iteration ``warmup`` on."""
    def loop(body: nn.Module, head: nn.Module, body_opt: torch.optim.Optimizer, head_opt: torch.optim.Optimizer,
             bad: int) -> int:
        for step in range(STEPS):
            loss = head(body(torch.randn(4, 8) * (float("nan") if step == bad else 1.0))).pow(2).mean()
            body_opt.zero_grad()
            head_opt.zero_grad()
            loss.backward()
            if body_first and step >= warmup:
                body_opt.step()
            head_opt.step()
            if not body_first and step >= warmup:
                body_opt.step()
        return step
    return loop


LOOPS = {
    **{f"every-{k}th-{'first' if first else 'last'}": _occasional(k, first) for k in (2, 3, 5) for first in (1, 0)},
    "critic-3": _critic(3), "critic-5": _critic(5),
    "both-body-first": _both(True), "both-head-first": _both(False),
    "warmup-10-body-first": _both(True, 10), "warmup-10-body-last": _both(False, 10),
}


def _fail_at(loop: Loop, bad: int, passed: bool, options: dict) -> tuple[int, str]:
    torch.manual_seed(0)
    body, head = nn.Linear(8, 8), nn.Linear(8, 1)
    body_opt, head_opt = torch.optim.SGD(body.parameters(), lr=0.01), torch.optim.SGD(head.parameters(), lr=0.01)
    targets = (body, head, body_opt, head_opt) if passed else (body, head)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*targets, **options):
        loop(body, head, body_opt, head_opt, bad)
    report = caught.value.report
    return report.step, report.phase.value


@pytest.mark.parametrize("passed", [True, False], ids=["passed", "found"])
@pytest.mark.parametrize("name", LOOPS)
def test_the_loop_s_step_whatever_the_order(name: str, passed: bool) -> None:
    for bad in (0, 1, 2, 3, 5, 6, 10, 11, 12):
        step, phase = _fail_at(LOOPS[name], bad, passed, {})
        if name.startswith("critic") and bad == 0 and not passed:
            # (not passed: the generator is unknown until its first step, and the critic's loop is found then)
            continue
        assert (bad, phase, step) == (bad, "data", bad)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["every-3th-first", "critic-5", "warmup-10-body-first"])
def test_the_loop_s_step_in_every_mode(name: str, mode: str) -> None:
    for bad in (2, 11):
        for passed in (True, False):
            assert _fail_at(LOOPS[name], bad, passed, MODES[mode]) == (bad, "data")


@pytest.mark.parametrize("passed", [True, False], ids=["passed", "found"])
def test_a_critic_loop_s_history_holds_each_generator_step_once(passed: bool) -> None:
    torch.manual_seed(0)
    gen, critic = nn.Linear(8, 8), nn.Linear(8, 1)
    gen_opt, critic_opt = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(critic.parameters(), lr=0.01)
    with nan_magic.watch(*((gen, critic, gen_opt, critic_opt) if passed else (gen, critic))) as watch:
        _critic(3)(gen, critic, gen_opt, critic_opt, -1)
    assert watch.history[-1].step == STEPS - 1


def test_a_gan_s_two_optimizers_each_after_its_own_backward_are_one_iteration() -> None:
    """A GAN (discriminator then generator, each after its backward) stays one iteration per pair of steps."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(8, 8), nn.Linear(8, 1)
    gen_opt, disc_opt = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(disc.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(gen, disc, gen_opt, disc_opt):
        for step in range(6):
            loss_d = disc(gen(torch.randn(4, 8)).detach()).mean() - disc(torch.randn(4, 8)).mean()
            disc_opt.zero_grad()
            loss_d.backward()
            disc_opt.step()
            loss_g = -disc(gen(torch.randn(4, 8) * (float("nan") if step == 4 else 1.0))).mean()
            gen_opt.zero_grad()
            loss_g.backward()
            gen_opt.step()
    assert (step, caught.value.report.step) == (4, 4)


# -- iteration 0's later model calls, no optimizer passed (the call sites: step_sites.py) -----------------------------

def _pair() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    encoder, projector = nn.Linear(8, 8), nn.Linear(8, 4)
    return encoder, projector, torch.optim.SGD([*encoder.parameters(), *projector.parameters()], lr=0.1)


def _embed(encoder: nn.Module, projector: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return projector(encoder(x))


def _unroll(encoder: nn.Module, h: torch.Tensor, bad: bool) -> torch.Tensor:
    for t in range(4):
        h = encoder(h * (float("nan") if bad and t == 2 else 1.0)).tanh()
    return h


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [0, 2])
def test_two_views_through_a_helper_on_two_lines_fail_at_the_loop_s_step(mode: str, bad: int) -> None:
    """SimCLR's views embedded by a helper called from two lines: the second view's NaN at the loop's step."""
    encoder, projector, opt = _pair()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(encoder, projector, **MODES[mode]):
        for step in range(4):
            z1 = _embed(encoder, projector, torch.randn(4, 8))
            z2 = _embed(encoder, projector, torch.randn(4, 8) * (float("nan") if step == bad else 1.0))
            loss = (z1 * z2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert (step, caught.value.report.phase.value, caught.value.report.step) == (bad, "data", bad)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [0, 2])
def test_a_rollout_in_a_helper_s_loop_fails_at_the_loop_s_step(mode: str, bad: int) -> None:
    encoder, _, opt = _pair()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(encoder, **MODES[mode]):
        for step in range(4):
            loss = _unroll(encoder, torch.randn(4, 8), step == bad).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert (step, caught.value.report.phase.value, caught.value.report.step) == (bad, "data", bad)


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_a_rollout_in_a_while_loop_fails_at_the_loop_s_step(mode: str) -> None:
    encoder, _, opt = _pair()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(encoder, **MODES[mode]):
        for step in range(3):
            h, t = torch.randn(4, 8), 0
            while t < 3:
                h = encoder(h * (float("nan") if step == 0 and t == 2 else 1.0)).tanh()
                t += 1
            loss = h.pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert (step, caught.value.report.step, caught.value.report.model_call) == (0, 0, 3)


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_an_eval_loop_with_two_views_through_a_helper_counts_a_step_each_call(mode: str) -> None:
    """No optimizer step in its loop: the inference rule, a step each call of the step's first module (as before)."""
    encoder, projector, opt = _pair()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(encoder, projector, **MODES[mode]):
        for i in range(4):
            _embed(encoder, projector, torch.randn(4, 8))
            _embed(encoder, projector, torch.randn(4, 8) * (float("nan") if i == 2 else 1.0))
    assert (i, caught.value.report.step) == (2, 5)
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_an_eval_loop_sharing_its_body_with_training_under_a_flag_counts_a_step_each_call(mode: str) -> None:
    """The loop's code steps an optimizer under ``if train``; evaluated (train False), one call an iteration from the
    same place: a step each iteration."""
    encoder, projector, opt = _pair()
    train = False
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(encoder, projector, **MODES[mode]):
        for i in range(6):
            out = projector(encoder(torch.randn(4, 8) * (float("nan") if i == 4 else 1.0)))
            if train:
                opt.zero_grad()
                out.sum().backward()
                opt.step()
    assert (i, caught.value.report.step) == (4, 4)


def test_two_optimizers_stepping_gradients_set_by_hand_count_an_iteration_each_pair() -> None:
    """No backward anywhere (autograd.grad, the gradients assigned): the two steps of an iteration share none, and
    the first optimizer stepping again starts the next iteration."""
    torch.manual_seed(0)
    body, head = nn.Linear(8, 8), nn.Linear(8, 1)
    body_opt, head_opt = torch.optim.SGD(body.parameters(), lr=0.01), torch.optim.SGD(head.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(body, head):
        for step in range(8):
            out = head(body(torch.randn(4, 8) * (float("nan") if step == 5 else 1.0))).sum()
            params = [*body.parameters(), *head.parameters()]
            for parameter, grad in zip(params, torch.autograd.grad(out, params), strict=True):
                parameter.grad = grad
            body_opt.step()
            head_opt.step()
    assert (step, caught.value.report.step) == (5, 5)
