"""Healthy training that must stay silent, second part: what the program's *structure* does.

Sparse tensors in the model (an input, a module's output) and in the loss code, modules that appear, grow or
materialise under the watch, the user's own hooks, wrappers and tensor subclasses, backward calls of other shapes,
a second model trained beside the watched one. The harness (what a row returns, and how it is compared) is calm26.py's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from contract import Case, Scenario
from contract.calm26 import finish, training


def _lazy_modules() -> Scenario:
    """LazyLinear and LazyConv1d: the parameters are uninitialized when the watch starts, made by the first call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyConv1d(4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(5, 3, 8)

    def run() -> tuple[Any, ...]:
        model(x)  # materialise (a dry run, as the docs say), then the optimizer
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model,), run)


class SparseGCN(nn.Module):
    """A GCN whose normalised adjacency comes in as a sparse COO tensor (node 4 is isolated: its row is empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.sparse.mm(adj, torch.relu(self.a(x))))


class Propagate(torch.autograd.Function):
    """``adj @ h`` with its backward written out (``adj.t() @ g``), the sparse adjacency saved for it."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(adj)
        return torch.sparse.mm(adj, h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (adj,) = ctx.saved_tensors
        return torch.sparse.mm(adj.t(), grad), None


def _graph() -> torch.Tensor:
    edges = torch.tensor([[0, 1, 1, 2, 3], [1, 0, 2, 1, 3]])
    return torch.sparse_coo_tensor(edges, torch.full((5,), 0.5), (5, 5), check_invariants=True).coalesce()


def _sparse_graph_loss() -> Scenario:
    """The adjacency goes into the model and into the loss code: a smoothness term ``h . (A h)`` by
    ``torch.sparse.mm`` and by a custom Function, and a sparse product densified."""
    torch.manual_seed(0)
    model = SparseGCN()
    adj, x = _graph(), torch.randn(5, 4)

    def loss_of(step: int) -> torch.Tensor:
        h = model(adj, x)
        smooth = (h * torch.sparse.mm(adj, h)).sum() + (h * Propagate.apply(h, adj)).sum()
        return h.pow(2).mean() + 0.1 * smooth + 0.01 * (adj * 2).to_dense().sum()

    return training(model, loss_of)


class EdgeWeights(nn.Module):
    """Learned edge weights: returns the weighted adjacency itself as a sparse COO tensor (a module output)."""

    def __init__(self) -> None:
        super().__init__()
        self.edges = _graph().indices()
        self.logit = nn.Parameter(torch.zeros(self.edges.shape[1]))

    def forward(self) -> torch.Tensor:
        return torch.sparse_coo_tensor(self.edges, torch.sigmoid(self.logit), (5, 5))


class LearnedGraph(SparseGCN):
    def __init__(self) -> None:
        super().__init__()
        self.adjacency = EdgeWeights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(self.adjacency(), x)


def _sparse_module_output() -> Scenario:
    torch.manual_seed(0)
    model = LearnedGraph()
    x = torch.randn(5, 4)
    return training(model, lambda s: model(x).pow(2).mean())


def _sparse_gradient_by_hand() -> Scenario:
    """``nn.Embedding(sparse=True)`` updated by hand: its sparse COO gradient scaled in place, then applied."""
    torch.manual_seed(0)
    model = nn.Embedding(10, 4, sparse=True)
    adj, ids = _graph(), torch.tensor([1, 2, 3, 4, 5])

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            loss = Propagate.apply(model(ids), adj).pow(2).sum()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                grad = model.weight.grad
                grad.mul_(0.5)
                model.weight.add_(grad, alpha=-0.1)
            losses.append(loss.detach())
        return finish(losses, model)

    return Scenario((model,), run)


def _grows_mid_run() -> Scenario:
    """Progressive growing: a layer appended to the ModuleList at step 2, its parameters added as a new group."""
    torch.manual_seed(0)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8)])
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.tanh(block(x))
            return self.head(x)

    model = Stack()
    extra = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(4):
            if step == 2:
                model.blocks.append(extra)
                opt.add_param_group({"params": extra.parameters(), "lr": 0.001})
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _user_hooks_rewrite() -> Scenario:
    """The user's hooks change what flows: a pre-hook with kwargs scales the input, a prepended forward hook
    adds a steering vector to the output, an always-call hook returns a new tuple."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    steer = torch.randn(16)
    model[0].register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 0.5,), kwargs), with_kwargs=True)
    model[0].register_forward_hook(lambda m, args, out: out + steer, prepend=True)
    model[2].register_forward_hook(lambda m, args, out: out.clamp(-1, 1) * 2, always_call=True)
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x).pow(2).mean())


class Queries(nn.Module):
    """DETR's learned queries: a module called with no input that returns its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(4, 8))

    def forward(self) -> torch.Tensor:
        return self.query


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.queries = Queries()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, memory: torch.Tensor) -> torch.Tensor:
        q = self.queries().expand(len(memory), -1, -1)
        return self.attn(q, memory, memory, need_weights=False)[0]


def _parameter_as_output() -> Scenario:
    torch.manual_seed(0)
    model = Decoder()
    memory = torch.randn(3, 5, 8)
    return training(model, lambda s: model(memory).pow(2).mean())


def _vector_backward() -> Scenario:
    """``out.backward(gradient)`` of a non-scalar, then ``autograd.backward`` of two roots at once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        out = []
        for step in range(3):
            y = model(x)
            opt.zero_grad()
            if step % 2:
                torch.autograd.backward([y[:, 0].sum(), y[:, 1]], [None, torch.full((6,), 0.1)])
            else:
                y.backward(torch.full_like(y, 0.1))
            opt.step()
            out.append(y.detach())
        return finish(out, model, opt)

    return Scenario((model, opt), run)


class ForwardingWrapper(nn.Module):
    """A PEFT-style wrapper: ``__getattr__`` falls back to the wrapped model's attributes."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.scale = nn.Parameter(torch.ones(()))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def _forwarding_wrapper() -> Scenario:
    torch.manual_seed(0)
    model = ForwardingWrapper(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x).pow(2).mean())


class Logged(torch.Tensor):
    """A tensor subclass with its own ``__torch_function__`` (a user's tracing tool; torchvision's tv_tensors)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def _subclass_input() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(6, 8).as_subclass(Logged)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach().as_subclass(torch.Tensor))
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _prune_mid_run() -> Scenario:
    """Magnitude pruning applied after the first step (a forward pre-hook and a mask buffer appear under the
    watch), made permanent after the second."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(4):
            if step == 1:
                prune.l1_unstructured(model[0], "weight", amount=0.5)
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
            if step == 3:
                prune.remove(model[0], "weight")
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario((model,), run)


def _retain_grad_partial_backward() -> Scenario:
    """``retain_grad()`` on an activation (logged), and ``backward(inputs=...)`` that trains the head only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        out = []
        for step in range(3):
            h = model[1](model[0](x))
            h.retain_grad()
            loss = model[2](h).pow(2).mean()
            opt.zero_grad()
            loss.backward(inputs=[*model[2].parameters(), h] if step else None)
            opt.step()
            out += [loss.detach(), h.grad.clone()]
        return finish(out, model, opt)

    return Scenario((model, opt), run)


def _anomaly_mode() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 2))
    x = torch.randn(6, 8)

    def loss_of(step: int) -> torch.Tensor:
        with torch.autograd.set_detect_anomaly(True):
            return model(x).pow(2).mean()

    return training(model, loss_of)


def _second_model_unwatched() -> Scenario:
    """A second model, not passed to watch, trained with dropout by its own optimizer in the same loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 2))
    other = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            side = (other(x) - loss.detach()).pow(2).mean()
            other_opt.zero_grad()
            side.backward()
            other_opt.step()
            losses += [loss.detach(), side.detach()]
        return finish(losses, model, opt, other, other_opt)

    return Scenario((model, opt), run)


def _default_dtype_float64() -> Scenario:
    """Training in float64 by ``set_default_dtype`` inside the cell (restored after)."""
    torch.manual_seed(0)

    def run() -> tuple[Any, ...]:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            x = torch.randn(6, 8)
            losses = []
            for _ in range(3):
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            return finish(losses, model, opt)
        finally:
            torch.set_default_dtype(previous)

    return Scenario((), run)


def _jagged_input() -> Scenario:
    """Variable-length sequences as a jagged nested tensor: a Linear over it, a mean per sequence."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    seqs = [torch.randn(n, 8) for n in (3, 5, 2)]

    def loss_of(step: int) -> torch.Tensor:
        nt = torch.nested.nested_tensor(seqs, layout=torch.jagged)
        return model(nt).values().pow(2).mean()

    return training(model, loss_of)


ROWS = {
    "prune-mid-run": _prune_mid_run,
    "retain-grad-partial-backward": _retain_grad_partial_backward,
    "anomaly-mode": _anomaly_mode,
    "second-model-unwatched": _second_model_unwatched,
    "default-dtype-float64": _default_dtype_float64,
    "jagged-input": _jagged_input,
    "lazy-modules": _lazy_modules,
    "sparse-graph-in-model-and-loss-code": _sparse_graph_loss,
    "sparse-gradient-scaled-by-hand": _sparse_gradient_by_hand,
    "sparse-adjacency-as-a-module-output": _sparse_module_output,
    "layer-and-group-added-mid-run": _grows_mid_run,
    "user-hooks-rewrite-args-and-outputs": _user_hooks_rewrite,
    "module-returns-its-parameter": _parameter_as_output,
    "vector-and-multi-root-backward": _vector_backward,
    "getattr-forwarding-wrapper": _forwarding_wrapper,
    "tensor-subclass-input": _subclass_input,
}

CASES = [Case(f"calm26_{name}", build, None, benign=0) for name, build in ROWS.items()]
