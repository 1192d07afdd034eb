"""What a cell's namespace holds for the watch: its models, optimizers and GradScalers.

``%%nantrace`` and ``%nanwatch`` without targets watch every top-level module,
optimizer and GradScaler the user namespace holds, and any model first called
or optimizer first stepping while the cell runs (:func:`target_namer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nan_magic.hot.watched.called_as import called_as
from nan_magic.hot.watched.targets import _is_grad_scaler

__all__ = ["discover", "models_on_a_device", "namespace_scalers", "target_namer"]


def discover(namespace: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """Every top-level module, optimizer and GradScaler in the user namespace.

    A module contained in another discovered module is left to its container
    (watched once, under the container's names).
    """
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name, value in list(namespace.items()):
        if name.startswith("_") or id(value) in seen:
            continue
        if isinstance(value, (nn.Module, torch.optim.Optimizer)) or _is_grad_scaler(value):
            found.append((name, value))
            seen.add(id(value))
    contained: set[int] = set()
    for _name, value in found:
        if isinstance(value, nn.Module):
            contained |= {id(sub) for sub in value.modules() if sub is not value}
    kept = [(name, value) for name, value in found if id(value) not in contained]
    return [name for name, _ in kept], [value for _, value in kept]


def namespace_scalers(namespace: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """The GradScalers in the user namespace, each once, with their names (as :func:`discover` finds them)."""
    scalers = [(name, value) for name, value in zip(*discover(namespace)) if _is_grad_scaler(value)]
    return [name for name, _ in scalers], [value for _, value in scalers]


def models_on_a_device(namespace: dict[str, Any]) -> bool:
    """Whether a model in the namespace lives off the CPU (the watch then defers its checks)."""
    for value in list(namespace.values()):
        if isinstance(value, nn.Module):
            parameter = next(value.parameters(), None)
            if parameter is not None and parameter.device.type != "cpu":
                return True
    return False


def target_namer(namespace: dict[str, Any], expressions: list[str]) -> Callable[[Any], str | None]:
    """How a model first called at top level, or an optimizer first stepping, joins the watch.

    Without targets, every model joins, under the container item its call
    takes it as (``parts['decoder']``), or its name in the namespace (or its
    class name); every optimizer is watched anyway. With targets, one
    joins when a target expression, looked up again now, is that object: a
    cell that rebuilds ``model, opt`` is watched on the new ones, and
    nothing else is.
    """

    def name_new_target(target: Any) -> str | None:
        if not expressions:
            # As the calling line takes it from a container (``parts['decoder'](x)``), before a name that happens to
            # be bound to it (a loop variable an earlier cell left): hot/watched/called_as.py.
            called = called_as(target)
            if called is not None:
                return called
            names = (name for name, value in list(namespace.items()) if value is target and not name.startswith("_"))
            return next(names, type(target).__name__)
        for expression in expressions:
            try:
                if eval(expression, namespace) is target:
                    return expression
            except Exception:  # a name the cell has deleted, say: not this object
                continue
        return None

    return name_new_target
