"""Where the known gaps of the fifteenth round named the wrong place (gaps16): multi-loss steps, the gradient
penalty's double backward, update code that writes gradients.

A second loss computed after the first ``backward()`` (an auxiliary loss with its own backward, two accumulated
losses, a second output's loss): its code runs where the update region is recorded, and goes on as loss code when
its own ``backward()`` starts (localize/outside/loop_writes.py's ``loss_starts``). Each with a healthy twin that must
stay calm and compute what it computes unwatched.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from nan_magic.records import TensorRef, TensorRole


def _zeroed_at_2(out: torch.Tensor, step: int) -> torch.Tensor:
    """The output with its first row zeroed at step 2 (a dead sample): the norm of that row is 0."""
    return out * torch.tensor([[0.0], [1.0], [1.0]]) if step == 2 else out


# ---------------------------------------------------------------- a second loss, its own backward
def _second_output_loss(safe: bool) -> Scenario:
    """Two outputs, two losses, two backwards, no graph retained: the second loss (a row norm, sqrt's backward
    1 / 0 at the dead row of step 2) is computed after the first backward returned."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.randn(2, 3, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out_a, out_b = model(xs[step][0]), model(xs[step][1])
            opt.zero_grad()
            first = out_a.pow(2).mean()
            first.backward()
            rows = _zeroed_at_2(out_b, step).pow(2).sum(-1)
            second = (rows + 1e-12).sqrt().sum() if safe else rows.sqrt().sum()  # producer: second output sqrt
            second.backward()
            opt.step()
            losses += [first.detach(), second.detach()]
        return losses
    return Scenario((model, opt), run)


def _both_losses_first(safe: bool) -> Scenario:
    """Both losses computed before either backward (no graph retained: they share none): the second's backward,
    its sqrt's 1 / 0 at step 2, runs after the first backward's end let the loss code's records go."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.randn(2, 3, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out_a, out_b = model(xs[step][0]), model(xs[step][1])
            rows = _zeroed_at_2(out_b, step).pow(2).sum(-1)
            first = out_a.pow(2).mean()
            second = (rows + 1e-12).sqrt().sum() if safe else rows.sqrt().sum()  # producer: both first sqrt
            opt.zero_grad()
            first.backward()
            second.backward()
            opt.step()
            losses += [first.detach(), second.detach()]
        return losses
    return Scenario((model, opt), run)


def _separate_forwards(safe: bool) -> Scenario:
    """Gradient accumulation over two forwards, each loss with its own backward: the second's sqrt at step 2."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.randn(2, 3, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            opt.zero_grad()
            first = model(xs[step][0]).pow(2).mean() / 2
            first.backward()
            rows = _zeroed_at_2(model(xs[step][1]), step).pow(2).sum(-1)
            second = (rows + 1e-12).sqrt().mean() / 2 if safe else rows.sqrt().mean() / 2  # producer: accumulated sqrt
            second.backward()
            opt.step()
            losses += [first.detach(), second.detach()]
        return losses
    return Scenario((model, opt), run)


def _auxiliary_log_after_backward(safe: bool) -> Scenario:
    """The main loss's backward keeps the graph; an auxiliary loss on the same output, computed after it, takes the
    log of a row's squared norm: -inf in the forward at step 2's dead row."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.randn(3, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out = _zeroed_at_2(model(xs[step]), step)
            opt.zero_grad()
            main = out.pow(2).mean()
            main.backward(retain_graph=True)
            energy = out.pow(2).sum(-1)
            aux = -torch.log(energy.clamp_min(1e-12) if safe else energy).mean()  # producer: auxiliary log
            aux.backward()
            opt.step()
            losses += [main.detach(), aux.detach()]
        return losses
    return Scenario((model, opt), run)


def _auxiliary_loss_then_clipping(safe: bool) -> Scenario:
    """As the retained second loss, with gradient clipping after the second backward: the update region after it
    runs clipping's ops and writes no parameter, so the next steps' regions are watched, not recorded (only their
    last ops kept): the second loss's code is among them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.randn(3, 4) for _ in range(5)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(5):
            out = model(xs[step])
            out = out * torch.tensor([[0.0], [1.0], [1.0]]) if step == 3 else out
            opt.zero_grad()
            main = out.pow(2).mean()
            main.backward(retain_graph=True)
            rows = out.pow(2).sum(-1)
            aux = (rows + 1e-12).sqrt().sum() if safe else rows.sqrt().sum()  # producer: clipped aux sqrt
            aux.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses += [main.detach(), aux.detach()]
        return losses
    return Scenario((model, opt), run)


CASES = [
    Case("gaps16_second_output_loss_after_the_first_backward", lambda: _second_output_loss(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="second output sqrt", cause="sqrt-domain")),
    Case("gaps16_second_output_loss_eps_healthy", lambda: _second_output_loss(True), None),
    Case("gaps16_both_losses_before_either_backward", lambda: _both_losses_first(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="both first sqrt", cause="sqrt-domain")),
    Case("gaps16_both_losses_before_either_backward_eps_healthy", lambda: _both_losses_first(True), None),
    Case("gaps16_accumulated_second_loss_of_a_second_forward", lambda: _separate_forwards(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="accumulated sqrt", cause="sqrt-domain")),
    Case("gaps16_accumulated_second_loss_eps_healthy", lambda: _separate_forwards(True), None),
    Case("gaps16_auxiliary_log_after_a_retained_backward", lambda: _auxiliary_log_after_backward(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="auxiliary log")),
    Case("gaps16_auxiliary_log_clamped_healthy", lambda: _auxiliary_log_after_backward(True), None),
    Case("gaps16_auxiliary_loss_then_clipping", lambda: _auxiliary_loss_then_clipping(False),
         Expect("backward", None, step=3, op="aten.div.Tensor", marker="clipped aux sqrt", cause="sqrt-domain")),
    Case("gaps16_auxiliary_loss_then_clipping_healthy", lambda: _auxiliary_loss_then_clipping(True), None),
]


# ---------------------------------------------------------------- gradient penalties: autograd.grad(create_graph=True)
def _dead_critic() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _kill(critic: nn.Sequential) -> None:
    """Every ReLU of the critic off (a dead first layer): its input gradient is exactly 0."""
    with torch.no_grad():
        critic[0].weight.zero_()
        critic[0].bias.fill_(-1.0)


def _penalty(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor, safe: bool) -> torch.Tensor:
    """WGAN-GP's penalty in a helper that returns it: the norm of the critic's gradient at mixed points, by hand."""
    alpha = torch.rand(real.size(0), 1)
    mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    (g,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
    norm = g.norm(2, dim=1) if safe else torch.sqrt((g ** 2).sum(1))  # producer: helper penalty sqrt
    return ((norm - 1) ** 2).mean()


def _penalty_in_a_helper(safe: bool) -> Scenario:
    """The penalty computed in a helper the loop calls (its frame returned by the backward): the critic's first
    layer dies at step 2, the gradient is 0, and sqrt's backward at 0 (the double backward's) is 1 / 0."""
    critic = _dead_critic()
    opt = torch.optim.SGD(critic.parameters(), lr=0.0)
    reals, fakes = [torch.randn(4, 4) for _ in range(4)], [torch.randn(4, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                _kill(critic)
            gp = _penalty(critic, reals[step], fakes[step], safe)
            loss = critic(fakes[step]).mean() - critic(reals[step]).mean() + 10 * gp
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((critic, opt), run)


def _gan_with_a_penalty(safe: bool) -> Scenario:
    """A WGAN-GP loop, generator and critic each with its optimizer: the critic's step holds the penalty (its
    first layer dead at iteration 2, sqrt's backward 1 / 0), the generator's step follows with the critic called
    on its output."""
    critic = _dead_critic()
    generator = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 4))
    opt_d = torch.optim.SGD(critic.parameters(), lr=0.0)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.0)
    reals, zs = [torch.randn(4, 4) for _ in range(4)], [torch.randn(4, 2) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                _kill(critic)
            fake = generator(zs[step])
            d_loss = critic(fake.detach()).mean() - critic(reals[step]).mean() + 10 * _penalty(
                critic, reals[step], fake.detach(), safe)
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = -critic(generator(zs[step])).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            losses += [d_loss.detach(), g_loss.detach()]
        return losses
    return Scenario((generator, critic, opt_g, opt_d), run)


def _r1_norm(safe: bool) -> Scenario:
    """R1 regularisation: the gradient of the critic's output at the real images, its norm taken with a sqrt of
    the squared norm (1 / 0 in the double backward where the critic is dead, step 2); the twin keeps the squared
    norm, as R1 is written."""
    critic = _dead_critic()
    opt = torch.optim.SGD(critic.parameters(), lr=0.0)
    reals, fakes = [torch.randn(4, 4) for _ in range(4)], [torch.randn(4, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                _kill(critic)
            real = reals[step].clone().requires_grad_(True)
            d_real = critic(real)
            (g,) = torch.autograd.grad(d_real.sum(), real, create_graph=True)
            squared = g.pow(2).sum(1)
            r1 = squared if safe else squared.sqrt()  # producer: r1 sqrt
            loss = F.softplus(-d_real).mean() + F.softplus(critic(fakes[step])).mean() + 5 * r1.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((critic, opt), run)


def _r1_of_a_log(safe: bool) -> Scenario:
    """R1 of ``log(sigmoid(D(x)))``: at step 2 the critic's logit is -200, its sigmoid 0 and the log -inf (in the
    loss code, before autograd.grad differentiates it); the twin takes ``logsigmoid``."""
    critic = _dead_critic()
    opt = torch.optim.SGD(critic.parameters(), lr=0.0)
    reals = [torch.randn(4, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    critic[2].weight.zero_()
                    critic[2].bias.fill_(-200.0)
            real = reals[step].clone().requires_grad_(True)
            logit = critic(real)
            log_d = F.logsigmoid(logit) if safe else torch.log(torch.sigmoid(logit))  # producer: r1 log
            (g,) = torch.autograd.grad(log_d.sum(), real, create_graph=True)
            loss = -log_d.mean() + 5 * g.pow(2).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((critic, opt), run)


def _weight_norm_penalty(safe: bool) -> Scenario:
    """A group-lasso penalty written in the loss code, ``sum(sqrt(sum(w ** 2)))`` over the layers' weights: the
    loss code reads the parameters themselves (no model output between). At step 2 a layer is pruned to 0, and
    sqrt's backward at 0 is 1 / 0 in that weight's gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.randn(5, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model[2].weight.zero_()
            fit = model(xs[step]).pow(2).mean()
            eps = 1e-12 if safe else 0.0
            lasso = sum(torch.sqrt((w ** 2).sum() + eps) for w in (model[0].weight, model[2].weight))  # producer: lasso
            loss = fit + 1e-3 * lasso
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- update code that writes the gradients
def _gradients_per_token(safe: bool) -> Scenario:
    """Gradient accumulation's division by hand: the summed token losses' gradients divided by the number of
    tokens, ``p.grad /= tokens``, between backward and step; at step 2 the batch is all padding (0 tokens)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(6, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        for step in range(4):
            mask = torch.zeros(6) if step == 2 else torch.ones(6)
            loss = (model(xs[step]).squeeze(-1).pow(2) * mask).sum()
            opt.zero_grad()
            loss.backward()
            tokens = mask.sum().clamp_min(1.0) if safe else mask.sum()
            for p in model.parameters():
                p.grad /= tokens  # producer: per-token division
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    return Scenario((model, opt), run)


def _clip_by_hand(safe: bool) -> Scenario:
    """Gradient normalisation written in the loop: ``c = 1 / total_norm``, ``p.grad.mul_(c)``; at step 2 the loss is
    0 (a batch fully masked), every gradient is 0, the total norm 0 and ``c`` inf (then 0 * inf in the mul_)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(6, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        for step in range(4):
            loss = model(xs[step]).pow(2).mean() * (0.0 if step == 2 else 1.0)
            opt.zero_grad()
            loss.backward()
            total = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
            c = 1.0 / (total + 1e-6) if safe else 1.0 / total  # producer: clip coefficient
            for p in model.parameters():
                p.grad.mul_(c)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    return Scenario((model, opt), run)


def _gradients_normalised(safe: bool) -> Scenario:
    """The healthy twin of opsgaps15's per-parameter normalisation (``g / (|g| + eps)``), and the same with the
    norm kept first: ``n = g.norm(); g.div_(n)``, two lines."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(3, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        for step in range(4):
            loss = model(xs[step]).pow(2).mean() * (0 if step == 2 else 1)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                n = p.grad.norm()
                p.grad.div_(n + 1e-12 if safe else n)  # producer: normalised in two lines
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    return Scenario((model, opt), run)


CASES += [
    Case("gaps16_gradient_penalty_in_a_returned_helper", lambda: _penalty_in_a_helper(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="helper penalty sqrt", cause="sqrt-domain")),
    Case("gaps16_gradient_penalty_in_a_returned_helper_by_norm_healthy", lambda: _penalty_in_a_helper(True), None),
    Case("gaps16_wgan_gp_loop_with_the_generator_step", lambda: _gan_with_a_penalty(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="helper penalty sqrt", cause="sqrt-domain")),
    Case("gaps16_wgan_gp_loop_with_the_generator_step_by_norm_healthy", lambda: _gan_with_a_penalty(True), None),
    Case("gaps16_r1_penalty_square_rooted", lambda: _r1_norm(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="r1 sqrt", cause="sqrt-domain")),
    Case("gaps16_r1_penalty_squared_healthy", lambda: _r1_norm(True), None),
    Case("gaps16_group_lasso_of_a_pruned_weight", lambda: _weight_norm_penalty(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="lasso", cause="sqrt-domain")),
    Case("gaps16_group_lasso_with_eps_healthy", lambda: _weight_norm_penalty(True), None),
    Case("gaps16_gradients_divided_by_a_token_count_of_zero", lambda: _gradients_per_token(False),
         # (the loop's update code made it, outside every module: the gradient keeps its owner's name, the producer
         # is that code, not the Linear whose backward computed a finite gradient)
         Expect("backward", None, step=2, op="aten.div_.Tensor", marker="per-token division",
                tensor=TensorRef(TensorRole.PARAMETER_GRADIENT, "0.weight", ""))),
    Case("gaps16_gradients_divided_by_a_clamped_token_count_healthy", lambda: _gradients_per_token(True), None),
    Case("gaps16_clip_by_hand_of_a_zero_norm", lambda: _clip_by_hand(False),
         Expect("backward", None, step=2, op="aten.reciprocal.default", marker="clip coefficient",
                tensor=TensorRef(TensorRole.PARAMETER_GRADIENT, "0.weight", ""))),
    Case("gaps16_clip_by_hand_with_eps_healthy", lambda: _clip_by_hand(True), None),
    Case("gaps16_gradient_divided_by_its_norm_in_two_lines", lambda: _gradients_normalised(False),
         Expect("backward", None, step=2, op="aten.div_.Tensor", marker="normalised in two lines",
                tensor=TensorRef(TensorRole.PARAMETER_GRADIENT, "0.weight", ""))),
    Case("gaps16_gradient_divided_by_its_norm_plus_eps_healthy", lambda: _gradients_normalised(True), None),
    Case("gaps16_r1_penalty_of_a_log_sigmoid", lambda: _r1_of_a_log(False),
         # (its event is inside the loop's own autograd.grad: replayed from that grad's output, op_origins.py)
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="r1 log", cause="log-domain")),
    Case("gaps16_r1_penalty_of_a_logsigmoid_healthy", lambda: _r1_of_a_log(True), None),
]
