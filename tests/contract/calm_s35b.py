"""Healthy training that must stay silent in every mode (session 35, part two): what the program's structure does.

A dict output holding None, an optimizer made inside the watch or grown by ``add_param_group``, two models sharing
a module, weight tying, an orthogonal parametrization, sparse embedding gradients under SparseAdam, a learning-rate
finder that stops itself, anomaly detection and inference-mode evaluation inside the watch, a model moved to
float64 mid-loop, the user's own hooks (forward, pre-forward with kwargs, backward-pre, global, always-called),
modes (TorchFunctionMode, TorchDispatchMode) and saved-tensor hooks around the step, an optimizer stepped in
backward, freezing and unfreezing, partial backward, resumed state dicts, a momentum encoder, pruning mid-loop,
a multi-grad hook and a head re-initialised by ``model.apply``. The harness (and
what each row returns) is calm_s35.py's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from contract import Case, Scenario
from contract.calm26 import finish, training
from contract.calm_s35 import _mlp, traceless


def _loop(model: nn.Module, opt: torch.optim.Optimizer, step_of: Any, steps: int = 3,
          targets: tuple[Any, ...] | None = None, held: tuple[Any, ...] = ()) -> Scenario:
    """``steps`` calls of ``step_of(step)`` (the whole step, returning its loss)."""

    def run() -> tuple[Any, ...]:
        losses = [step_of(step).detach() for step in range(steps)]
        return finish(losses, model, opt, *held)

    return Scenario(targets if targets is not None else (model, opt), run)


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, loss_of: Any) -> Any:
    def step_of(step: int) -> torch.Tensor:
        loss = loss_of(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return step_of


# -- outputs and optimizers ---------------------------------------------------------------------------------------


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h = torch.relu(self.body(x))
        logits = self.head(h)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits, "hidden": h, "past": None, "n": 3}


def _dict_output_with_none() -> Scenario:
    """A Hugging Face-style output: a dict holding the loss (None when called without labels), None and an int."""
    torch.manual_seed(0)
    model = DictOut()
    x, y = torch.randn(6, 8), torch.randint(0, 2, (6,))

    def loss_of(step: int) -> torch.Tensor:
        preview = model(x)["logits"].detach()
        return model(x, labels=y)["loss"] + 0 * preview.sum()

    return training(model, loss_of)


def _optimizer_made_in_the_cell() -> Scenario:
    """``watch(model)`` alone; the optimizer and scheduler are made inside the watched cell."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    held: list[Any] = []

    def run() -> tuple[Any, ...]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        held.append(opt)
        losses = []
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model,), run)


def _shared_module() -> Scenario:
    """Two models (an actor and a critic) sharing one encoder module, both watched, one optimizer over both."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    actor, critic = nn.Sequential(encoder, nn.Linear(16, 3)), nn.Sequential(encoder, nn.Linear(16, 1))
    params = list({id(p): p for p in [*actor.parameters(), *critic.parameters()]}.values())
    opt = torch.optim.Adam(params, lr=1e-2)
    x, a, r = torch.randn(6, 8), torch.randint(0, 3, (6,)), torch.randn(6)

    def loss_of(step: int) -> torch.Tensor:
        value = critic(x).squeeze(-1)
        logp = actor(x).log_softmax(-1).gather(1, a[:, None]).squeeze(-1)
        return -(logp * (r - value).detach()).mean() + F.mse_loss(value, r)

    scenario = training(actor, loss_of, opt, targets=(actor, critic, opt))
    run = scenario.run
    return Scenario(scenario.targets, lambda: (run(), finish([], critic)), scenario.options)


def _add_param_group() -> Scenario:
    """A second head added to the optimizer at step 2 by ``add_param_group`` (progressive growing)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(8, 16), "a": nn.Linear(16, 2), "b": nn.Linear(16, 2)})
    opt = torch.optim.Adam([*model["body"].parameters(), *model["a"].parameters()], lr=1e-2)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def step_of(step: int) -> torch.Tensor:
        if step == 2:
            opt.add_param_group({"params": list(model["b"].parameters()), "lr": 5e-3})
        h = torch.relu(model["body"](x))
        loss = F.mse_loss(model["a"](h), y) + (F.mse_loss(model["b"](h), y) if step >= 2 else 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop(model, opt, step_of, steps=4)


class FinderStop(Exception):
    pass


def _lr_finder_stops_itself() -> Scenario:
    """A learning-rate finder: the rate grows 4x a step until the loss exceeds 4x its best (finite), the finder's
    own exception is raised and caught, and the model and optimizer are restored from copies."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 2)

    def run() -> tuple[Any, ...]:
        saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        losses, best = [], float("inf")
        try:
            for _ in range(30):
                loss = F.mse_loss(model(x), y)
                losses.append(loss.detach())
                best = min(best, loss.item())
                if loss.item() > 4 * best:
                    raise FinderStop
                opt.zero_grad()
                loss.backward()
                opt.step()
                for group in opt.param_groups:
                    group["lr"] *= 4
        except FinderStop:
            pass
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return finish([*losses, loss.detach()], model, opt)

    return Scenario((model, opt), run)


# -- shared and reparametrized weights, sparse gradients --------------------------------------------------------


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


def _weight_tying() -> Scenario:
    torch.manual_seed(0)
    model = TiedLM()
    tokens = torch.randint(0, 20, (4, 6))
    return training(model, lambda s: F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()))


def _orthogonal() -> Scenario:
    """``nn.utils.parametrizations.orthogonal`` on a square layer, and ``weight_norm``'s parametrization."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    nn.utils.parametrizations.orthogonal(model[0])
    nn.utils.parametrizations.weight_norm(model[2])
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    return training(model, lambda s: F.mse_loss(model(x), y), torch.optim.Adam(model.parameters(), lr=1e-2))


def _sparse_embedding() -> Scenario:
    """``Embedding(sparse=True)`` under SparseAdam, the dense rest under Adam: two optimizers, both watched."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"embed": nn.Embedding(30, 8, sparse=True), "head": nn.Linear(8, 2)})
    sparse = torch.optim.SparseAdam(list(model["embed"].parameters()), lr=1e-2)
    dense = torch.optim.Adam(model["head"].parameters(), lr=1e-2)
    ids, y = torch.randint(0, 30, (6, 4)), torch.randn(6, 2)

    def step_of(step: int) -> torch.Tensor:
        loss = F.mse_loss(model["head"](model["embed"](ids).mean(1)), y)
        sparse.zero_grad()
        dense.zero_grad()
        loss.backward()
        sparse.step()
        dense.step()
        return loss

    return _loop(model, sparse, step_of, targets=(model, sparse, dense), held=(dense,))


# -- the user's own hooks, modes and saved-tensor hooks ------------------------------------------------------------


def _user_forward_hooks() -> Scenario:
    """A forward hook returning a new output (a channel mask), a pre-hook with kwargs rewriting the input, a
    backward pre-hook scaling the gradient of the output, and an always-called hook prepended before the others."""
    torch.manual_seed(0)
    model = _mlp()
    keep = torch.tensor([1.0, 0.0] * 8)
    seen: list[int] = []
    model[0].register_forward_hook(lambda m, args, out: out * keep)
    model[0].register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 0.5,), kwargs), with_kwargs=True)
    model[2].register_full_backward_pre_hook(lambda m, grad_out: (grad_out[0] * 0.25,))
    model.register_forward_hook(lambda m, args, out: seen.append(1), always_call=True, prepend=True)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    scenario = training(model, lambda s: F.mse_loss(model(x), y))
    run = scenario.run
    return Scenario(scenario.targets, lambda: (run(), len(seen)), scenario.options)


def _global_module_hook() -> Scenario:
    """A global forward hook of the user's (``register_module_forward_hook``: activation statistics) on while
    the watch is on, removed after the loop."""
    torch.manual_seed(0)
    model = _mlp()
    stats: list[torch.Tensor] = []
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    scenario = training(model, lambda s: F.mse_loss(model(x), y))
    run = scenario.run

    def hooked() -> Any:
        handle = nn.modules.module.register_module_forward_hook(
            lambda m, args, out: stats.append(out.detach().abs().mean()) if isinstance(out, torch.Tensor) else None)
        try:
            return run(), stats
        finally:
            handle.remove()

    return Scenario(scenario.targets, hooked, scenario.options)


class CountingFunctions(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


class CountingOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def _user_mode(kind: str) -> Scenario:
    """A user's own TorchFunctionMode or TorchDispatchMode (counting what runs) entered around each whole step."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    step = _plain_step(model, opt, lambda s: F.mse_loss(model(x), y))
    modes: list[Any] = []

    def step_of(s: int) -> torch.Tensor:
        mode = CountingFunctions() if kind == "function" else CountingOps()
        modes.append(mode)
        with mode:
            return step(s)

    return _loop(model, opt, step_of)


def _saved_tensor_hooks() -> Scenario:
    """The user's own saved-tensor hooks around forward and backward: ``save_on_cpu`` and a pack/unpack pair that
    stores clones (counting them)."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    packed: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(1)
        return t.clone()

    def step_of(step: int) -> torch.Tensor:
        hooks = (torch.autograd.graph.save_on_cpu() if step % 2 else
                 torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        with hooks:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
        opt.step()
        return loss

    return _loop(model, opt, step_of)


def _optimizer_in_backward() -> Scenario:
    """One optimizer per parameter, stepped by ``register_post_accumulate_grad_hook`` as its gradient is ready
    (the gradient freed at once): no ``opt.step()`` in the loop."""
    torch.manual_seed(0)
    model = _mlp()
    opts = {p: torch.optim.SGD([p], lr=0.05, momentum=0.9) for p in model.parameters()}

    def hook(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.detach())
        for handle in handles:
            handle.remove()
        return finish(losses, model, *opts.values())

    return Scenario((model,), run)


# -- anomaly detection, evaluation, dtypes, freezing, partial backward, resuming ------------------------------------


def _detect_anomaly() -> Scenario:
    """``torch.autograd.detect_anomaly()`` around every forward and backward inside the watch."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step_of(step: int) -> torch.Tensor:
        with torch.autograd.detect_anomaly(check_nan=True):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
        opt.step()
        return loss

    return _loop(model, opt, step_of)


def _inference_mode_targets() -> Scenario:
    """Self-distillation: the model's own outputs under ``torch.inference_mode()`` (an eval pass) cloned into
    targets for the next training step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 2))
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def loss_of(step: int) -> torch.Tensor:
        model.eval()
        with torch.inference_mode():
            soft = model(x).softmax(-1)
        model.train()
        soft = soft.clone()
        out = model(x)
        return F.mse_loss(out, y) + F.kl_div(out.log_softmax(-1), soft, reduction="batchmean")

    return training(model, loss_of)


def _to_float64_mid_loop() -> Scenario:
    """The model moved to float64 by ``.to(torch.float64)`` after the second step (the same parameters, the
    optimizer's state cast by hand), the data with it."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def step_of(step: int) -> torch.Tensor:
        nonlocal x, y
        if step == 2:
            model.to(torch.float64)
            x, y = x.double(), y.double()
            for state in opt.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = state[key].double()
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop(model, opt, step_of, steps=4)


def _freeze_unfreeze() -> Scenario:
    """The first layer frozen (``requires_grad_(False)``, gradient set to None) for two steps, then unfrozen."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def step_of(step: int) -> torch.Tensor:
        model[0].requires_grad_(step not in (1, 2))
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop(model, opt, step_of, steps=4)


def _partial_backward() -> Scenario:
    """``loss.backward(inputs=...)`` for the head only on odd steps, ``autograd.grad`` written to ``.grad`` on
    even steps."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def step_of(step: int) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        if step % 2:
            loss.backward(inputs=list(model[2].parameters()))
        else:
            params = list(model.parameters())
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = g
        opt.step()
        return loss

    return _loop(model, opt, step_of, steps=4)


def _resume_state_dicts() -> Scenario:
    """A checkpoint taken at step 1 (model and optimizer state dicts) and loaded back at step 3, as a run
    resuming after a rollback."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    saved: dict[str, Any] = {}

    def step_of(step: int) -> torch.Tensor:
        if step == 1:
            saved.update(model=copy.deepcopy(model.state_dict()), opt=copy.deepcopy(opt.state_dict()))
        if step == 3:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop(model, opt, step_of, steps=5)


class Byol(nn.Module):
    """An online network and a momentum target updated by EMA under no_grad inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.online = _mlp(out=4)
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        self.predict = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for t, o in zip(self.target.parameters(), self.online.parameters()):
                t.mul_(0.9).add_(o, alpha=0.1)
            z = F.normalize(self.target(b), dim=-1)
        return 2 - 2 * (F.normalize(self.predict(self.online(a)), dim=-1) * z).sum(-1).mean()


def _momentum_encoder() -> Scenario:
    torch.manual_seed(0)
    model = Byol()
    x = torch.randn(6, 8)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    return training(model, lambda s: model(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)), opt)


def _default_dtype_and_determinism() -> Scenario:
    """The cell sets float64 as the default dtype and turns deterministic algorithms on, building the model
    inside the watch, and puts both back after its loop."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    made: list[Any] = []

    def run() -> tuple[Any, ...]:
        before = torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
        try:
            torch.manual_seed(1)
            model = _mlp()
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            made.extend([model, opt])
            losses = []
            for _ in range(3):
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        finally:
            torch.set_default_dtype(before[0])
            torch.use_deterministic_algorithms(before[1])
        return finish(losses, model, opt)

    return Scenario((), run)


def _pruned_mid_loop() -> Scenario:
    """``nn.utils.prune.l1_unstructured`` applied to a watched layer at step 1 (a forward pre-hook, a
    ``weight_orig`` parameter and a mask buffer added mid-loop; the optimizer given the new parameter), made
    permanent by ``prune.remove`` at step 3."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def step_of(step: int) -> torch.Tensor:
        if step == 1:
            nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.5)
            opt.param_groups[0]["params"] = list(model.parameters())
        if step == 3:
            nn.utils.prune.remove(model[0], "weight")
            opt.param_groups[0]["params"] = list(model.parameters())
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop(model, opt, step_of, steps=5)


def _multi_grad_hook_and_reinit() -> Scenario:
    """A user's ``register_multi_grad_hook`` over the model's outputs (counting the gradients it sees), and the
    head re-initialised by ``model.apply`` at step 2 (a restart of the head, as in a reset schedule)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(8, 16), "a": nn.Linear(16, 2), "b": nn.Linear(16, 2)})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    seen: list[int] = []

    def reinit(m: nn.Module) -> None:
        if m is model["b"]:
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def step_of(step: int) -> torch.Tensor:
        if step == 2:
            model.apply(reinit)
        h = torch.tanh(model["body"](x))
        a, b = model["a"](h), model["b"](h)
        handle = torch.autograd.graph.register_multi_grad_hook(
            (a, b), lambda grads: seen.append(sum(g is not None for g in grads)))
        loss = F.mse_loss(a, y) + F.mse_loss(b, y)
        opt.zero_grad()
        loss.backward()
        handle.remove()
        opt.step()
        return loss

    scenario = _loop(model, opt, step_of, steps=4)
    run = scenario.run
    return Scenario(scenario.targets, lambda: (run(), list(seen)), scenario.options)


ROWS = {
    "dict-output-holding-none": _dict_output_with_none,
    "optimizer-made-in-the-cell": _optimizer_made_in_the_cell,
    "two-models-sharing-an-encoder": _shared_module,
    "add-param-group-mid-loop": _add_param_group,
    "lr-finder-stops-itself": _lr_finder_stops_itself,
    "weight-tying": _weight_tying,
    "orthogonal-and-weight-norm-parametrizations": _orthogonal,
    "sparse-embedding-sparse-adam-and-adam": _sparse_embedding,
    "user-forward-and-backward-hooks": _user_forward_hooks,
    "user-global-module-forward-hook": _global_module_hook,
    "user-torch-function-mode": lambda: _user_mode("function"),
    "user-torch-dispatch-mode": lambda: _user_mode("dispatch"),
    "user-saved-tensor-hooks": _saved_tensor_hooks,
    "optimizer-in-backward": _optimizer_in_backward,
    "detect-anomaly-in-the-watch": _detect_anomaly,
    "inference-mode-self-distillation": _inference_mode_targets,
    "to-float64-mid-loop": _to_float64_mid_loop,
    "freeze-then-unfreeze": _freeze_unfreeze,
    "partial-backward-and-autograd-grad": _partial_backward,
    "resume-state-dicts-mid-loop": _resume_state_dicts,
    "momentum-encoder-in-forward": _momentum_encoder,
    "default-dtype-and-determinism-in-the-cell": _default_dtype_and_determinism,
    "pruned-mid-loop": _pruned_mid_loop,
    "multi-grad-hook-and-reinit-by-apply": _multi_grad_hook_and_reinit,
}

CASES = [Case(f"calm_s35b_{name}", lambda build=build: traceless(build()), None, benign=0)
         for name, build in ROWS.items()]
