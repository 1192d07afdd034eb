"""The layout of each optimizer's parameters (step_layout.Layout): their names, how their gradient norms are taken,
their half-precision state; built once and rebuilt only when the parameters change.

Part of the optimizer checks (step_checks.py), kept apart because it runs only when a layout changes; the step's
hot path asks :meth:`Layouts.layout` once and reads the layout it returns.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from nan_magic.distributed.ranks import data_parallel_paths, local_shard, user_name
from nan_magic.hot.checks.optimizer.running_stats import running_stats_of
from nan_magic.hot.checks.optimizer.step_layout import Layout
from nan_magic.hot.reads import DOT_MIN_NUMEL, WIDE_FLOATS, is_checkable
from nan_magic.hot.watched.targets import Targets

__all__ = ["FLAT_MAX_NUMEL", "Layouts", "holds"]

#: The small CPU gradients of a step are copied into one flat buffer for their norm up to this many elements
#: in all (16 MB of float32); beyond, a norm per gradient costs less than the copy.
FLAT_MAX_NUMEL = 1 << 22


class Layouts:
    """One watch's optimizer layouts and parameter names (the watched models' ``targets``)."""

    def __init__(self, targets: Targets) -> None:
        self.targets = targets
        self._parameter_names: dict[int, str] = {}
        self._layouts: dict[int, Layout] = {}

    def layout(self, opt: torch.optim.Optimizer) -> Layout:
        """The optimizer's named parameters and half-precision state, rebuilt when they change."""
        param_groups = opt.param_groups  # (one group, the usual: no generator over them, every step)
        signature = tuple(map(id, param_groups[0]["params"] if len(param_groups) == 1
                              else itertools.chain.from_iterable(group["params"] for group in param_groups)))
        layout, first = self._layouts.get(id(opt)), opt.param_groups[0]["params"] if opt.param_groups else ()
        dtype = first[0].dtype if first else None
        if layout is None or layout.signature != signature or layout.dtype is not dtype:
            named = self.named_parameters(opt)
            wide = all(parameter.dtype in WIDE_FLOATS for _name, parameter in named)
            # A gradient has its parameter's dtype and shape (autograd and the
            # ``.grad`` setter enforce it), so this is decided once per layout.
            # A sharded (FSDP2) parameter's gradient is checked as this rank's shard (_gradients).
            floating = [(name, parameter) for name, parameter in named if is_checkable(local_shard(parameter))]
            layout = self._layouts[id(opt)] = Layout(signature, named, floating, wide, dtype=dtype,
                                                    ids=frozenset(signature))
            # How the step's gradient norms are taken (step_checks.py's _gradient_norms): a large CPU gradient alone,
            # the others in one fused call per (device, dtype); a sharded parameter's the generic way.
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for _name, parameter in floating:
                if parameter.is_cpu and parameter.dtype in WIDE_FLOATS and parameter.numel() >= DOT_MIN_NUMEL:
                    layout.large.append(parameter)
                else:
                    groups.setdefault((parameter.device, parameter.dtype), []).append(parameter)
            layout.groups = list(groups.values())
            layout.flat_ok = sum(parameter.numel() for group in layout.groups for parameter in group) <= FLAT_MAX_NUMEL
            layout.generic = any(local_shard(parameter) is not parameter for _name, parameter in floating)
            # One (CPU, float32 or float64) group holding every parameter, none large: the launch-bound regime,
            # where a norm per parameter costs a call each and one concatenation is cheaper (step_checks.py).
            layout.one_sum = (wide and layout.flat_ok and not layout.large and not layout.generic
                              and len(layout.groups) == 1 and len(floating) == len(named)
                              and layout.groups[0][0].is_cpu)
            layout.running = running_stats_of(self.targets.roots, set(signature), self.targets.buffer_versions)
        if layout.state_count != len(opt.state):
            # Optimizers create state lazily, at their first step.
            layout.state_count = len(opt.state)
            layout.half_state = [
                (name, parameter, key)
                for name, parameter in layout.named
                for key, value in opt.state.get(parameter, {}).items()
                if is_checkable(value) and value.dim() > 0 and value.element_size() < 4
            ]
        return layout

    def named_parameters(self, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        """The optimizer's parameters under their names in the watched models, looked up once per watch (a walk of a
        large model every step would cost more than the checks); a parameter added since triggers one new walk."""
        names = self._parameter_names
        if any(id(p) not in names for group in opt.param_groups for p in group["params"]):
            names.clear()
            for _label, root in self.targets.roots:
                data_parallel = data_parallel_paths(root)
                for name, parameter in root.named_parameters():
                    names.setdefault(id(parameter), user_name(name, data_parallel))
            # Parameters outside every watched model keep their position as name.
            for group_index, group in enumerate(opt.param_groups):
                for position, parameter in enumerate(group["params"]):
                    names.setdefault(id(parameter), f"param_groups[{group_index}][{position}]")
        return [
            (names[id(parameter)], parameter) for group in opt.param_groups for parameter in group["params"]
        ]


def holds(optimizers: Iterable[object], opt: object) -> bool:
    """Whether ``opt`` itself is among ``optimizers`` (by identity; a loop, not a generator: asked every step)."""
    for known in optimizers:  # noqa: SIM110 - any() over a generator is a Python call per optimizer
        if known is opt:
            return True
    return False
