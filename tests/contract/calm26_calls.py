"""Healthy training that must stay silent, fourth part: how the model's modules get called.

A child compiled by TorchScript (scripted, traced) or by ``torch.compile`` inside an eager parent, a root module
that calls itself (a tree-structured recursive net), a forward that normalises its input batch in place, a
submodule's error that the loop catches and recovers from, the user's own global module hooks (a profiler's).
The harness is calm26.py's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from contract import Case, Scenario
from contract.calm26 import finish, training


class WithChild(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.child = child
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.child(torch.tanh(self.a(x))))


def _child(kind: str):
    def build() -> Scenario:
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        if kind == "scripted":
            inner = torch.jit.script(inner)
        elif kind == "traced":
            inner = torch.jit.trace(inner, torch.randn(2, 8))
        else:
            inner = torch.compile(inner, backend="eager")
        model = WithChild(inner)
        x = torch.randn(6, 8)
        return training(model, lambda s: model(x).pow(2).mean())
    return build


class Tree(nn.Module):
    """A recursive net over a binary tree: the root module calls itself on each subtree."""

    def __init__(self) -> None:
        super().__init__()
        self.leaf = nn.Linear(4, 8)
        self.combine = nn.Linear(16, 8)

    def forward(self, tree: Any) -> torch.Tensor:
        if isinstance(tree, torch.Tensor):
            return torch.tanh(self.leaf(tree))
        left, right = tree
        return torch.tanh(self.combine(torch.cat([self(left), self(right)], -1)))


def _recursive_root() -> Scenario:
    torch.manual_seed(0)
    model = Tree()
    leaves = [torch.randn(2, 4) for _ in range(5)]
    tree = ((leaves[0], leaves[1]), ((leaves[2], leaves[3]), leaves[4]))
    return training(model, lambda s: model(tree).pow(2).mean())


class InPlaceNorm(nn.Module):
    """Old code's normalisation: the batch standardised in place on entry (the caller's tensor changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean(0)).div_(x.std(0) + 1e-5)
        return self.lin(x)


def _input_normalised_in_place() -> Scenario:
    torch.manual_seed(0)
    model = InPlaceNorm()
    data = torch.randn(6, 8) * 3 + 1
    return training(model, lambda s: model(data.clone()).pow(2).mean())


def _caught_submodule_error() -> Scenario:
    """Every other step the loop first tries a batch of the wrong width: the first Linear raises, the loop
    catches the error, logs it and trains on the right batch (a batch-size probe, a bad-sample skipper)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    good, bad = torch.randn(6, 8), torch.randn(6, 5)

    def run() -> tuple[Any, ...]:
        losses, errors = [], 0
        for step in range(4):
            if step % 2 == 0:
                try:
                    model(bad).sum().backward()
                except RuntimeError:
                    errors += 1
            loss = model(good).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return (*finish(losses, model, opt), errors)

    return Scenario((model, opt), run)


def _user_global_hooks() -> Scenario:
    """A profiler's global module hooks: one registered before the watch, one added and removed inside it; they
    see every call they see unwatched."""
    from torch.nn.modules import module as module_hooks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(6, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: list[str] = []

    def run() -> tuple[Any, ...]:
        seen.clear()
        before = module_hooks.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
        losses = []
        try:
            for step in range(3):
                inner = module_hooks.register_module_forward_pre_hook(
                    lambda m, a: seen.append("pre " + type(m).__name__)) if step == 1 else None
                loss = model(x).pow(2).mean()
                if inner is not None:
                    inner.remove()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        finally:
            before.remove()
        return (*finish(losses, model, opt), list(seen))

    return Scenario((model, opt), run)


ROWS = {
    "scripted-child": _child("scripted"),
    "traced-child": _child("traced"),
    "compiled-child": _child("compiled"),
    "recursive-root-module": _recursive_root,
    "input-normalised-in-place": _input_normalised_in_place,
    "caught-submodule-error": _caught_submodule_error,
    "user-global-module-hooks": _user_global_hooks,
}

CASES = [Case(f"calm26_{name}", build, None, benign=0) for name, build in ROWS.items()]
