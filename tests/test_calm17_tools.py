"""Training programs built on torch's tools stay calm and bit-identical in the five modes (issue 25; harness:
test_calm16.py's ``assert_calm``; test_calm16_loops.py has DP-SGD by vmap, a compiled Sequential, a plain LBFGS):

torch.func: an ensemble by ``stack_module_state`` and ``vmap(functional_call)``, MAML's inner loop on a
parameter dict (``autograd.grad(create_graph=True)``, the outer step through it), a Jacobian penalty by
``jacrev`` in the loss, a step computed by ``grad(has_aux=True)`` and written to ``.grad``. Parametrizations:
``orthogonal`` (matrix_exp, cayley, householder) in a recurrent cell, the new ``weight_norm`` beside it, a custom
one under ``parametrize.cached()``. ``torch.compile(backend="aot_eager")``: the nanoGPT model with generate, a
compiled loss function, a batch size that changes (a recompile). LBFGS with ``strong_wolfe``: a PINN whose closure
takes derivatives by ``autograd.grad``, after Adam. Callbacks in the cell: prints, a tqdm bar, matplotlib (Agg)
plots of the history and of weight histograms by ``.numpy()``, and fastai's LR finder (``best = inf``, the
loss allowed to grow 4x, the weights restored after). A model class defined and trained in one cell, that cell run
again (each under its own watch, no target: the modules called are found).
"""

from __future__ import annotations

import contextlib
import copy
import io
import math

import pytest
import torch
from test_calm16 import Loop, assert_calm, same
from test_calm17_programs import GPT
from torch import nn
from torch.func import functional_call, grad, jacrev, stack_module_state, vmap
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, weight_norm
from watching import FIVE_MODES

import nan_magic

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _mlp(d_in: int = 4, d_out: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out))


def _data(steps: int = 3, d_in: int = 4, classes: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(8, d_in), torch.randint(0, classes, (8,))) for _ in range(steps)]


# ---------------------------------------------------------------- torch.func


def ensemble():
    """Five models trained at once: their parameters stacked, one vmapped functional_call, one Adam over the stack."""

    def build() -> Loop:
        models = [_mlp() for _ in range(5)]
        base = copy.deepcopy(models[0]).to("meta")
        params, buffers = stack_module_state(models)
        opt = torch.optim.Adam(params.values(), lr=1e-2)
        data = _data()

        def run() -> list[torch.Tensor]:
            out = []
            for x, y in data:
                logits = vmap(lambda p, b, xi: functional_call(base, (p, b), (xi,)), in_dims=(0, 0, None))(
                    params, buffers, x
                )
                loss = F.cross_entropy(logits.flatten(0, 1), y.repeat(5))
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(logits.detach())
            return [*out, *params.values()]

        return Loop((models[0], opt), (opt,), run)

    return build


def maml():
    """Second-order MAML: two inner steps on a dict of fast weights, the query loss backward through them."""

    def build() -> Loop:
        model = _mlp(1, 1)
        meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def task() -> tuple[torch.Tensor, ...]:
            amp, phase = torch.rand(()) * 4 + 0.1, torch.rand(()) * math.pi
            xs, xq = torch.rand(5, 1) * 10 - 5, torch.rand(5, 1) * 10 - 5
            return xs, amp * torch.sin(xs + phase), xq, amp * torch.sin(xq + phase)

        def run() -> list[torch.Tensor]:
            out = []
            for _ in range(3):
                meta_opt.zero_grad()
                for _ in range(2):  # tasks per meta-batch
                    xs, ys, xq, yq = task()
                    fast = dict(model.named_parameters())
                    for _ in range(2):
                        inner = F.mse_loss(functional_call(model, fast, (xs,)), ys)
                        grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
                        fast = {k: w - 0.01 * g for (k, w), g in zip(fast.items(), grads, strict=True)}
                    query = F.mse_loss(functional_call(model, fast, (xq,)), yq) / 2
                    query.backward()
                    out.append(query.detach())
                meta_opt.step()
            return out

        return Loop((model, meta_opt), (model, meta_opt), run)

    return build


def jacobian_penalty():
    """A contractive penalty: the Frobenius norm of the input Jacobian, by ``vmap(jacrev)``, added to the loss."""

    def build() -> Loop:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = _data()

        def run() -> list[torch.Tensor]:
            out = []
            for x, y in data:
                jac = vmap(jacrev(lambda xi: model(xi[None])[0]))(x)
                loss = F.cross_entropy(model(x), y) + 0.1 * jac.pow(2).sum((1, 2)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            return out

        return Loop((model, opt), (model, opt), run)

    return build


def func_grad_step():
    """The step computed functionally: ``grad(loss, has_aux=True)`` over the detached parameters, written to
    ``.grad``, then the optimizer's step (a JAX-style loop on a torch optimizer)."""

    def build() -> Loop:
        model = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = _data(4)

        def loss_fn(params: dict, x: torch.Tensor, y: torch.Tensor):
            logits = functional_call(model, params, (x,))
            return F.cross_entropy(logits, y), logits.argmax(-1)

        def run() -> list[torch.Tensor]:
            out = []
            for x, y in data:
                params = {k: v.detach() for k, v in model.named_parameters()}
                grads, preds = grad(loss_fn, has_aux=True)(params, x, y)
                for name, p in model.named_parameters():
                    p.grad = grads[name]
                opt.step()
                out.append(preds)
            return out

        return Loop((model, opt), (model, opt), run)

    return build


# ---------------------------------------------------------------- parametrizations


class OrthogonalRNN(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp = weight_norm(nn.Linear(3, 8))
        self.rec = orthogonal(nn.Linear(8, 8, bias=False), orthogonal_map=kind)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 8)
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(x[:, t]) + self.rec(h))
        return self.head(h)


class Softplus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x)


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def parametrized(kind: str):
    def build() -> Loop:
        if kind == "custom-cached":
            model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
            parametrize.register_parametrization(model[0], "weight", Symmetric())
            parametrize.register_parametrization(model[2], "bias", Softplus())
        else:
            model = OrthogonalRNN(kind)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        xs = [torch.randn(4, 5, 3) if kind != "custom-cached" else torch.randn(4, 6) for _ in range(3)]

        def run() -> list[torch.Tensor]:
            out = []
            for x in xs:
                with parametrize.cached() if kind == "custom-cached" else contextlib.nullcontext():
                    loss = F.cross_entropy(model(x) + model(x.flip(0)), torch.tensor([0, 1, 1, 0]))
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            with torch.no_grad():
                w = model[0].weight if kind == "custom-cached" else model.rec.weight
                out.append(w.clone())
            return out

        return Loop((model, opt), (model, opt), run)

    return build


# ---------------------------------------------------------------- torch.compile (aot_eager)


def compiled_gpt():
    """nanoGPT compiled as train.py does (``model = torch.compile(model)``), trained, then the raw model generates."""

    def build() -> Loop:
        raw = GPT(flash=True)
        model = torch.compile(raw, backend="aot_eager")
        opt = raw.configure_optimizers(0.1, 3e-3)
        data = torch.randint(0, 24, (120,))

        def run() -> list[torch.Tensor]:
            out = []
            for _ in range(3):
                ix = torch.randint(len(data) - 8, (4,))
                x = torch.stack([data[i : i + 8] for i in ix])
                y = torch.stack([data[i + 1 : i + 9] for i in ix])
                _, loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                out.append(loss.detach())
            raw.eval()
            out.append(raw.generate(torch.zeros(2, 1, dtype=torch.long), 6, top_k=4))
            raw.train()
            return out

        return Loop((model, opt), (raw, opt), run)

    return build


def compiled_loss(dynamic_batch: bool):
    """A focal loss compiled on its own, beside an eager model; optionally a batch size that changes every step."""

    @torch.compile(backend="aot_eager")
    def focal(logits: torch.Tensor, y: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
        logp = F.log_softmax(logits, -1).gather(1, y[:, None]).squeeze(1)
        return (-((1 - logp.exp()) ** gamma) * logp).mean()

    def build() -> Loop:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sizes = (8, 5, 7) if dynamic_batch else (8, 8, 8)
        data = [(torch.randn(n, 4), torch.randint(0, 3, (n,))) for n in sizes]

        def run() -> list[torch.Tensor]:
            out = []
            for x, y in data:
                loss = focal(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
            return out

        return Loop((model, opt), (model, opt), run)

    return build


# ---------------------------------------------------------------- LBFGS


def pinn():
    """u'' = -pi^2 sin(pi x) on [0, 1], u(0) = u(1) = 0: Adam first, then LBFGS(strong_wolfe) with a closure that
    takes u' and u'' by ``autograd.grad(create_graph=True)``."""

    def build() -> Loop:
        model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        adam = torch.optim.Adam(model.parameters(), lr=1e-2)
        lbfgs = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=8, line_search_fn="strong_wolfe")
        x = torch.linspace(0, 1, 16)[:, None].requires_grad_(True)
        ends = torch.tensor([[0.0], [1.0]])

        def loss_fn() -> torch.Tensor:
            u = model(x)
            du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
            d2u = torch.autograd.grad(du.sum(), x, create_graph=True)[0]
            residual = d2u + math.pi**2 * torch.sin(math.pi * x)
            return residual.pow(2).mean() + model(ends).pow(2).mean()

        def closure() -> torch.Tensor:
            lbfgs.zero_grad()
            loss = loss_fn()
            loss.backward()
            return loss

        def run() -> list[torch.Tensor]:
            out = []
            for _ in range(3):
                adam.zero_grad()
                loss = loss_fn()
                loss.backward()
                adam.step()
                out.append(loss.detach())
            for _ in range(2):
                out.append(lbfgs.step(closure).detach())
            return out

        return Loop((model, adam, lbfgs), (model, adam, lbfgs), run)

    return build


# ---------------------------------------------------------------- callbacks that print and plot


def with_callbacks(lr_finder: bool):
    """A Keras-like ``fit`` with callbacks: prints, a tqdm bar, matplotlib (Agg) plots of the losses and of the
    weights' histograms; or fastai's LR finder: lr grows 3x per step until the loss passes 4x its best (which
    starts at inf), then the weights and optimizer state are restored."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    tqdm = pytest.importorskip("tqdm").tqdm
    from matplotlib import pyplot as plt

    def build() -> Loop:
        model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3 if lr_finder else 0.05, momentum=0.9)
        data = _data(16 if lr_finder else 4)
        history: list[float] = []

        def on_step_end(step: int, loss: torch.Tensor, bar) -> None:
            history.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=opt.param_groups[0]["lr"])
            if step % 2 == 0:
                print(f"step {step}: loss {loss.item():.4f}, |w| {model[0].weight.norm():.3f}")

        def on_fit_end() -> None:
            fig, (left, right) = plt.subplots(1, 2)
            left.plot(history)
            left.set_yscale("log")
            right.hist(model[0].weight.detach().flatten().numpy(), bins=10)
            fig.savefig(io.BytesIO(), format="png")
            plt.close(fig)

        def run() -> list[torch.Tensor]:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict())) if lr_finder else None
            best, out = float("inf"), []
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                bar = tqdm(data, desc="fit")
                for step, (x, y) in enumerate(bar):
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    on_step_end(step, loss.detach(), bar)
                    out.append(loss.detach())
                    if lr_finder:
                        best = min(best, loss.item())
                        if loss.item() > 4 * best:
                            break
                        for group in opt.param_groups:
                            group["lr"] *= 3.0
                bar.close()
                on_fit_end()
            if lr_finder:
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
            return [*out, torch.tensor(history)]

        return Loop((model, opt), (model, opt), run)

    return build


TOOLS = {
    "func-ensemble-stack-module-state": ensemble(),
    "func-maml-second-order": maml(),
    "func-jacrev-penalty-in-loss": jacobian_penalty(),
    "func-grad-has-aux-into-dot-grad": func_grad_step(),
    "orthogonal-matrix-exp-with-weight-norm": parametrized("matrix_exp"),
    "orthogonal-cayley-with-weight-norm": parametrized("cayley"),
    "orthogonal-householder-with-weight-norm": parametrized("householder"),
    "custom-parametrizations-cached": parametrized("custom-cached"),
    "compile-aot-eager-nanogpt-then-generate": compiled_gpt(),
    "compile-aot-eager-loss-function": compiled_loss(dynamic_batch=False),
    "compile-aot-eager-loss-batch-size-changes": compiled_loss(dynamic_batch=True),
    "lbfgs-strong-wolfe-pinn-after-adam": pinn(),
    "callbacks-print-tqdm-matplotlib": with_callbacks(lr_finder=False),
    "callbacks-lr-finder-restores": with_callbacks(lr_finder=True),
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", TOOLS)
@pytest.mark.filterwarnings("ignore:nan_magic.*compiled with torch.compile")  # (ops, full: run eagerly, said so)
def test_programs_on_torchs_tools_are_calm_and_identical(name: str, options: dict) -> None:
    assert_calm(TOOLS[name], options)


def test_the_lr_finder_really_stops_on_a_growing_loss() -> None:
    torch.manual_seed(0)
    losses = TOOLS["callbacks-lr-finder-restores"]().run()[-1]
    assert len(losses) < 16 and losses[-1] > 4 * losses.min()


# ---------------------------------------------------------------- one cell: a class defined, a model trained


def cell() -> list[torch.Tensor]:
    """What one notebook cell does: define the model's class, build it, its optimizer and scheduler, train."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, padding=1)
            self.norm = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4 * 4 * 4, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(F.max_pool2d(F.relu(self.norm(self.conv(x))), 2).flatten(1))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    out = []
    for _ in range(4):
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.append(loss.detach())
    model.eval()
    with torch.no_grad():
        out.append(model(x).softmax(-1))
    return out + [t.detach().clone() for t in model.state_dict().values()]


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_model_defined_and_trained_in_one_cell_run_twice_is_calm_and_identical(options: dict) -> None:
    expected = cell() + cell()
    watches = []
    got = []
    for _ in range(2):  # the cell run again: a new class, a new model, a new watch with no target
        with nan_magic.watch(**options) as w:
            got += cell()
        watches.append(w)
    assert all(w.report is None and not w.events for w in watches), [(w.report, w.events) for w in watches]
    assert len(got) == len(expected) and all(same(a, b) for a, b in zip(got, expected, strict=True))
