"""hunt_s42b, several models in one loop, each event named in its own model.

Two recommendation towers of one class with sparse embeddings (``SparseAdam``): the second's sparse gradient,
normalised row by row by the loop, is named in it (it was named in the first). A GAN's ``G`` and ``D`` (both
``nn.Sequential``) found by ``watch()`` with no model: each joins under the name the loop calls it by (``D``, not a
second ``Sequential``), through a helper's parameter too; two models kept in a list, with no name of their own, are
``Sequential`` and ``Sequential#2``. The second model's BatchNorm running variance overflowing is named in that
model. The loop normalising the second model's gradients by hand (``p.grad /= p.grad.norm()``) before the second
optimizer steps: the op and its line in every mode (the update code's records are kept for that optimizer's check).
Further: a critic watched as a model of its own but called inside the generator's forward (its forward producer and
its parameter's own gradient, named in it by the tiered replay too); a model rebuilt mid-run under ``watch()``
(``model#2``); two ``DataParallel`` wrappers labelled by the class they hold; an actor-critic sharing a trunk; one
Adam over two models' param groups (a block two models share: hunt_s42b_shared.py).
Each with a healthy twin: the same code with an eps, a guard, or healthy data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from nan_magic.records import TensorRef, TensorRole


# ---------------------------------------------------------------- two towers of one class with sparse embeddings
def _sparse_towers(eps: float) -> Scenario:
    """Two towers (``Sequential(Embedding(sparse=True), Linear)``), each with ``SparseAdam`` for its embedding and
    SGD for the rest; the loop normalises each looked-up row of the embedding gradient (``g / ||g||``, row-wise
    update normalisation). The second tower's loss warms up from a weight of 0 at step 1: its rows' gradients are
    exactly 0, and ``0 / 0`` is NaN. Twin: the norm has an eps."""
    torch.manual_seed(0)
    towers = [nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)) for _ in range(2)]
    opts: list[torch.optim.Optimizer] = [torch.optim.SparseAdam(list(t[0].parameters()), lr=1e-2) for t in towers]
    opts += [torch.optim.SGD(list(t[1].parameters()), lr=1e-2) for t in towers]
    ids, ys = [torch.randint(0, 10, (6,)) for _ in range(3)], _batches(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            first, second = (F.mse_loss(tower(ids[step]), ys[step]) for tower in towers)
            loss = first + (0.0 if step == 1 else 1.0) * second
            for opt in opts:
                opt.zero_grad()
            loss.backward()
            for tower in towers:
                rows = tower[0].weight.grad.coalesce()
                values = rows._values()
                values.div_(values.norm(dim=1, keepdim=True) + eps)  # producer: sparse rows
                tower[0].weight.grad = rows
            for opt in opts:
                opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario(tuple(towers), run)


# ---------------------------------------------------------------- two models of one class found by watch()
class LogScale(nn.Module):
    """Log-magnitude features (no floor: "a feature is never exactly 0")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().log()  # producer: log scale


def _gan(dead: bool, helper: bool) -> Scenario:
    """A GAN's ``G`` and ``D``, both ``nn.Sequential`` with the same layers, found by ``watch()`` with no model (as a
    script's ``main()`` builds them), each with its own optimizer; ``D`` steps first. At step 2 D's first layer is
    pruned to exactly 0 (a pruning mask): ``log(0)`` in D's ``1``. ``helper``: both are called through
    ``forward(net, x)``, whose parameter names each alike. Twin: the layer is halved."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 4), LogScale(), nn.Linear(4, 4))
    D = nn.Sequential(nn.Linear(4, 4), LogScale(), nn.Linear(4, 1))
    opt_g, opt_d = torch.optim.SGD(G.parameters(), lr=1e-2), torch.optim.SGD(D.parameters(), lr=1e-2)
    zs = _batches(5, 4)

    def forward(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return net(x)

    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] = forward if helper else nn.Module.__call__

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    D[0].weight.mul_(0.0 if dead else 0.5)
                    D[0].bias.mul_(0.0 if dead else 0.5)
            loss = call(D, call(G, zs[step])).mean()
            opt_g.zero_grad()
            opt_d.zero_grad()
            loss.backward()
            opt_d.step()
            opt_g.step()
            losses.append(loss.detach())
        return losses

    return Scenario((), run)


def _listed(dead: bool) -> Scenario:
    """A student and a teacher of one class kept in a list (``nets[0]``, ``nets[1]``: no name of their own), found
    by ``watch()``; at step 2 the second's first layer is pruned to 0: ``log(0)`` in its ``1``. Twin: halved."""
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(4, 4), LogScale(), nn.Linear(4, 1)) for _ in range(2)]
    opts = [torch.optim.SGD(net.parameters(), lr=1e-2) for net in nets]
    xs, ys = _batches(5, 4), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    nets[1][0].weight.mul_(0.0 if dead else 0.5)
                    nets[1][0].bias.mul_(0.0 if dead else 0.5)
            loss = sum(F.mse_loss(nets[i](xs[step]), ys[step]) for i in range(2))
            for opt in opts:
                opt.zero_grad()
            loss.backward()
            for opt in opts:
                opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((), run)


# ---------------------------------------------------------------- the second model's BatchNorm running variance
def _twins_batch_norm(peak: float) -> Scenario:
    """Two models of one class with BatchNorm (an online and a target network), each with its own optimizer; at step
    1 the second's batch holds a sample of ``peak`` 3e19 (a raw count never scaled): the batch variance passes
    float32's max, BatchNorm's normalised output stays finite (x / inf), and its ``running_var`` becomes inf.
    Twin: peak 30."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in models]
    xs, views, ys = _batches(6, 4), _batches(6, 4), _batches(6, 1)
    views[1][2] = peak
    return Scenario(tuple(models), _side_by_side(models, opts, (xs, views), ys, 3))


def _side_by_side(models: Sequence[nn.Module], opts: Sequence[torch.optim.Optimizer],
                  inputs: Sequence[Sequence[torch.Tensor]], ys: Sequence[torch.Tensor], steps: int,
                  update: Callable[[int], None] = lambda step: None, quiet: int = 1
                  ) -> Callable[[], list[torch.Tensor]]:
    """Both models trained on one summed loss, each by its own optimizer, the second's loss weighted 0 at step
    ``quiet`` (a warmup); ``update(step)`` runs between backward and the steps (the loop's gradient code)."""

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(steps):
            first, second = (F.mse_loss(model(xs[step]), ys[step]) for model, xs in zip(models, inputs))
            loss = first + (0.0 if step == quiet else 1.0) * second
            for opt in opts:
                opt.zero_grad()
            loss.backward()
            update(step)
            for opt in opts:
                opt.step()
            losses.append(loss.detach())
        return losses

    return run


# ---------------------------------------------------------------- the loop normalising the second model's gradients
def _twins_normalised(eps: float, quiet: int = 1, optimizers_given: bool = False) -> Scenario:
    """Two models of one class, one optimizer each; the loop normalises the second's gradients by hand
    (``p.grad /= p.grad.norm()``, a LARS-like trust ratio) before the steps; its loss warms up from a weight of 0 at
    step ``quiet``, so its gradients are exactly 0: ``0 / 0``. At step 0 (``quiet`` 0) the second optimizer has not
    been seen stepping when the first steps. ``optimizers_given``: passed to ``watch`` too. Twin: the norm has an
    eps."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in models]
    xs, ys = _batches(5, 4), _batches(5, 1)

    def normalise(step: int) -> None:
        for p in models[1].parameters():
            assert p.grad is not None
            p.grad /= p.grad.norm() + eps  # producer: trust ratio

    run = _side_by_side(models, opts, (xs, xs), ys, 3, normalise, quiet)
    return Scenario((*models, *opts) if optimizers_given else tuple(models), run)


# ---------------------------------------------------------------- further: a model called inside another's forward
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.log = LogScale()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.log(self.fc(x)))


class Scored(nn.Module):
    """A generator whose forward scores its own sample with a critic it holds by no attribute (a closure over the
    training script's ``critic``, kept out of its ``state_dict`` on purpose)."""

    def __init__(self, critic: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.critic = [critic]  # (a list: not registered as a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic[0](self.fc(x))


def _inner_model(dead: bool) -> Scenario:
    """A critic (watched as a model of its own) called inside the generator's forward; at step 2 the critic's first
    layer is pruned to 0: ``log(0)`` in the critic's ``log``. The tiered replay of the generator's call named the
    generator's own code (``""``): the critic's modules were not in the replay's watch. Twin: halved."""
    torch.manual_seed(0)
    critic = Critic()
    generator = Scored(critic)
    opt = torch.optim.SGD([*generator.parameters(), *critic.parameters()], lr=1e-2)
    xs = _batches(5, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    critic.fc.weight.mul_(0.0 if dead else 0.5)
                    critic.fc.bias.mul_(0.0 if dead else 0.5)
            loss = generator(xs[step]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((generator, critic), run)


class RootScale(nn.Module):
    """Scales its input by ``sqrt(|s|)``: where ``s`` is exactly 0 only its own gradient is ``0 / 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s.abs().sqrt()  # producer: root scale


def _inner_backward(dead: bool) -> Scenario:
    """A critic (``Sequential(Linear, RootScale, Linear)``, watched as a model of its own) called inside the
    generator's forward; at step 2 its scale is pruned to exactly 0: only ``1.s``'s own gradient is ``0 / 0``. The
    tiered replay differentiated the generator's parameters only and named no op. Twin: halved."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 4), RootScale(), nn.Linear(4, 1))
    generator = Scored(critic)
    opt = torch.optim.SGD([*generator.parameters(), *critic.parameters()], lr=1e-2)
    xs = _batches(5, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    critic[1].s.mul_(0.0 if dead else 0.5)
            loss = generator(xs[step]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((generator, critic), run)


# ---------------------------------------------------------------- further: a model rebuilt mid-run, found by watch()
def _rebuilt(dead: bool) -> Scenario:
    """``model = Model()`` again half-way (a later cell re-run), found by ``watch()``: the first joined as ``model``,
    the second joins as ``model#2``; at its first step its first layer is 0 (a bad init): ``log(0)``. Twin: the
    default init."""
    torch.manual_seed(0)
    xs = _batches(5, 4)

    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), LogScale(), nn.Linear(4, 1))

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        losses = []
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        for step in range(2):
            loss = model(xs[step]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        if dead:
            with torch.no_grad():
                model[0].weight.zero_()
                model[0].bias.zero_()
        for step in range(2, 4):
            loss = model(xs[step]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((), run)


# ---------------------------------------------------------------- further: two DataParallel wrappers given unlabelled
def _two_wrapped(dead: bool) -> Scenario:
    """Two ``nn.DataParallel`` wrappers (on the CPU: they call their module) of one class, given to ``watch`` without
    labels: labelled by the class they hold (``Sequential#2``), as their modules are named without ``module.``; at
    step 2 the second's first layer is 0: ``log(0)``. Twin: halved."""
    torch.manual_seed(0)
    models = [nn.DataParallel(nn.Sequential(nn.Linear(4, 4), LogScale(), nn.Linear(4, 1))) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in models]
    xs = _batches(5, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    models[1].module[0].weight.mul_(0.0 if dead else 0.5)
                    models[1].module[0].bias.mul_(0.0 if dead else 0.5)
            loss = models[0](xs[step]).mean() + models[1](xs[step]).mean()
            for opt in opts:
                opt.zero_grad()
            loss.backward()
            for opt in opts:
                opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario(tuple(models), run)


# ---------------------------------------------------------------- further: an actor-critic with a shared trunk
def _actor_critic(dead: bool) -> Scenario:
    """An actor and a critic that share one trunk module, one Adam over both (the trunk once); at step 2 the critic
    head's first layer is pruned to 0: ``log(0)`` in the critic's ``head.1``. Twin: halved."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    actor = nn.ModuleDict({"trunk": trunk, "head": nn.Linear(4, 2)})
    critic = nn.ModuleDict({"trunk": trunk, "head": nn.Sequential(nn.Linear(4, 4), LogScale(), nn.Linear(4, 1))})

    class Policy(nn.Module):
        def __init__(self, parts: nn.ModuleDict) -> None:
            super().__init__()
            self.parts = parts

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.parts["head"](self.parts["trunk"](x))

    pi, value = Policy(actor), Policy(critic)
    opt = torch.optim.Adam([*pi.parameters(), *critic["head"].parameters()], lr=1e-3)
    xs = _batches(5, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    critic["head"][0].weight.mul_(0.0 if dead else 0.5)
                    critic["head"][0].bias.mul_(0.0 if dead else 0.5)
            logits, v = pi(xs[step]), value(xs[step])
            loss = -(logits.log_softmax(-1)[:, 0] * v.detach().squeeze(-1)).mean() + v.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((pi, value), run)


# ---------------------------------------------------------------- further: one Adam over two models' param groups
def _grouped(eps: float) -> Scenario:
    """One Adam over two models of one class, a param group each; the second group's ``eps`` is 0 and its
    embedding's row 9 is never looked up: ``0 / sqrt(0)`` at the first step, in that model. Twin: eps 1e-8."""
    torch.manual_seed(0)
    first, second = (nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)) for _ in range(2))
    opt = torch.optim.Adam([{"params": first.parameters()}, {"params": second.parameters(), "eps": eps}], lr=1e-3)
    ids, ys = [torch.randint(0, 9, (6,)) for _ in range(3)], _batches(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(first(ids[step]), ys[step]) + F.mse_loss(second(ids[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: grouped step
            losses.append(loss.detach())
        return losses

    return Scenario((first, second), run)


_SPARSE_ROWS_GAP = (
    "every mode names the gradient, its module and model and the step, but no op: the loop's div_ writes the sparse "
    "gradient's values tensor (``_values()``), which neither the update code's claim nor the op tracer follows back "
    "to the sparse gradient that holds it.")

_FOUND_OPTIMIZER_STEP = (
    "step 1, not 0: optimizers not given to watch() are counted as they are seen stepping, so the second one's "
    "check at iteration 0 runs after the first's step completed one (the same in every mode; given, it is step 0).")

CASES = [
    Case("hunt_s42b_second_tower_sparse_gradient_rows_normalised", lambda: _sparse_towers(0.0),
         Expect("backward", "0", "Embedding", step=1, op="aten.div_.Tensor", marker="sparse rows",
                tensor=TensorRef.gradient("0.weight"), model="Sequential#2", op_modes=()), note=_SPARSE_ROWS_GAP),
    Case("hunt_s42b_second_tower_sparse_gradient_healthy", lambda: _sparse_towers(1e-12), None),
    Case("hunt_s42b_discovered_gan_named_by_its_variable", lambda: _gan(True, False),
         Expect("forward", "1", "LogScale", step=2, op="aten.log.default", marker="log scale", model="D")),
    Case("hunt_s42b_discovered_gan_healthy", lambda: _gan(False, False), None),
    Case("hunt_s42b_discovered_gan_through_a_helper_named_by_the_callers_variable", lambda: _gan(True, True),
         Expect("forward", "1", "LogScale", step=2, op="aten.log.default", marker="log scale", model="D")),
    Case("hunt_s42b_discovered_gan_through_a_helper_healthy", lambda: _gan(False, True), None),
    Case("hunt_s42b_discovered_models_in_a_list_numbered", lambda: _listed(True),
         Expect("forward", "1", "LogScale", step=2, op="aten.log.default", marker="log scale",
                model="Sequential#2")),
    Case("hunt_s42b_discovered_models_in_a_list_healthy", lambda: _listed(False), None),
    Case("hunt_s42b_second_model_batch_norm_running_var_overflows", lambda: _twins_batch_norm(3e19),
         Expect("forward", "1", "BatchNorm1d", step=1, tensor=TensorRef(TensorRole.BUFFER, "1.running_var"),
                model="Sequential#2", op_modes=())),
    Case("hunt_s42b_second_model_batch_norm_healthy", lambda: _twins_batch_norm(30.0), None),
    Case("hunt_s42b_second_model_gradients_normalised_before_both_steps", lambda: _twins_normalised(0.0),
         Expect("backward", None, step=1, op="aten.div_.Tensor", marker="trust ratio",
                tensor=TensorRef.gradient("0.weight"), model="Sequential#2")),
    Case("hunt_s42b_second_model_gradients_normalised_healthy", lambda: _twins_normalised(1e-12), None),
    Case("hunt_s42b_second_model_gradients_normalised_at_step_0", lambda: _twins_normalised(0.0, 0, True),
         Expect("backward", None, step=0, op="aten.div_.Tensor", marker="trust ratio",
                tensor=TensorRef.gradient("0.weight"), model="Sequential#2")),
    Case("hunt_s42b_second_model_gradients_normalised_at_step_0_optimizers_found",
         lambda: _twins_normalised(0.0, 0), Expect(
             "backward", None, step=1, op="aten.div_.Tensor", marker="trust ratio",
             tensor=TensorRef.gradient("0.weight"), model="Sequential#2"), note=_FOUND_OPTIMIZER_STEP),
    Case("hunt_s42b_second_model_gradients_normalised_at_step_0_healthy", lambda: _twins_normalised(1e-12, 0), None),
    Case("hunt_s42b_a_model_called_inside_another_models_forward", lambda: _inner_model(True),
         Expect("forward", "log", "LogScale", step=2, op="aten.log.default", marker="log scale", model="Critic")),
    Case("hunt_s42b_a_model_called_inside_another_models_forward_healthy", lambda: _inner_model(False), None),
    Case("hunt_s42b_discovered_model_rebuilt_mid_run", lambda: _rebuilt(True),
         Expect("forward", "1", "LogScale", step=2, op="aten.log.default", marker="log scale", model="model#2")),
    Case("hunt_s42b_discovered_model_rebuilt_mid_run_healthy", lambda: _rebuilt(False), None),
    Case("hunt_s42b_two_data_parallel_wrappers_of_one_class", lambda: _two_wrapped(True),
         Expect("forward", "1", "LogScale", step=2, op="aten.log.default", marker="log scale", model="Sequential#2")),
    Case("hunt_s42b_two_data_parallel_wrappers_healthy", lambda: _two_wrapped(False), None),
    Case("hunt_s42b_actor_critic_shared_trunk_critic_head", lambda: _actor_critic(True),
         Expect("forward", "parts.head.1", "LogScale", step=2, op="aten.log.default", marker="log scale",
                model="Policy#2")),
    Case("hunt_s42b_actor_critic_shared_trunk_healthy", lambda: _actor_critic(False), None),
    Case("hunt_s42b_one_adam_over_two_models_groups_eps_0", lambda: _grouped(0.0),
         Expect("optimizer", "0", "Embedding", step=0, op="aten.addcdiv_.default", marker="grouped step",
                model="Sequential#2")),
    Case("hunt_s42b_one_adam_over_two_models_groups_healthy", lambda: _grouped(1e-8), None),
    Case("hunt_s42b_a_model_called_inside_another_models_forward_own_gradient", lambda: _inner_backward(True),
         Expect("backward", "1", "RootScale", step=2, op="aten.div.Tensor", marker="root scale",
                tensor=TensorRef.gradient("1.s"), model="Sequential")),
    Case("hunt_s42b_a_model_called_inside_another_models_forward_own_gradient_healthy",
         lambda: _inner_backward(False), None),
]
