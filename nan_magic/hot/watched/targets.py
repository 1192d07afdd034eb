"""What a watch looks at: modules (with their qualified names), optimizers, scalers.

Resolving targets never touches them: no hooks, no attributes, only a map
from module identity to the name the user knows it by. Nor does a module or
optimizer joining the watch once it runs (:meth:`Targets.join`,
:meth:`Targets.admit_optimizer`), or a submodule added to a model since (:meth:`Targets.adopt`).
"""

from __future__ import annotations

import fnmatch
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nan_magic.distributed.ranks import data_parallel_paths, user_path, user_type
from nan_magic.hot.watched.deterministic import draws_no_random, generators_of
from nan_magic.hot.watched.module_hooks import is_compiled
from nan_magic.hot.watched.root_labels import distinct_label, name_in_callers
from nan_magic.hot.watched.transparent import Transparency, transparency
from nan_magic.options import WatchConfig

__all__ = ["ModuleInfo", "Targets", "describe", "resolve_targets"]


@dataclass(frozen=True)
class ModuleInfo:
    """How one module is named and whether its calls are checked."""

    name: str
    module_type: str
    model: str | None
    watched: bool
    is_root: bool
    #: How its calls may be passed through unchecked (transparent.py); None: always checked.
    transparent: Transparency | None = None
    #: Its calls draw no random numbers: a replay needs no RNG state (deterministic.py).
    deterministic: bool = False
    #: A ``torch.compile`` wrapper (``OptimizedModule``): a full watch runs it eagerly (module_hooks.py).
    compiled: bool = False
    #: Its place in its model: the user's names from the root down (``name`` is them joined), ``()`` the root.
    path: tuple[str, ...] = ()
    #: The ``torch.Generator`` objects it and its submodules hold (``self.gen``): a replay of its call starts them
    #: from their states at the call (hot/kept/generators.py). Empty for almost every module.
    generators: tuple[torch.Generator, ...] = ()


@dataclass
class Targets:
    """Resolved targets of one watch.

    ``modules`` maps ``id(module)`` to its info; the strong references in
    ``roots`` keep those ids valid for the watch's lifetime. When no module was
    given, ``discover`` is true: any module called at top level becomes a root
    on the fly (used by scripts and the CLI).
    """

    roots: list[tuple[str | None, nn.Module]] = field(default_factory=list)
    modules: dict[int, ModuleInfo] = field(default_factory=dict)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    scalers: list[Any] = field(default_factory=list)
    discover: bool = False
    #: Which module first called at top level, or optimizer first seen
    #: stepping, joins the watch, and under what label (None: it stays
    #: unwatched). By default (None here): every module when no module was
    #: given (discovery), nothing else.
    name_new: Callable[[Any], str | None] | None = None
    #: Modules called inside a watched call that no model holds (one kept in a plain list), and optimizers of no
    #: watched parameter, by id: looked for once.
    outside: dict[int, weakref.ref[Any]] = field(default_factory=dict)
    #: A weak reference to each named module whose callback drops its info when the module is freed: a module
    #: swapped out of its model and freed leaves its id to the next object made, often another module (all
    #: modules are one size), which would otherwise be named and typed as the freed one.
    named: dict[int, weakref.ref[nn.Module]] = field(default_factory=dict)
    #: Each root's buffers' version counters when it joined the watch (before its first watched call), by id:
    #: the optimizer's first layout, built at its first step, tells the buffers that step's forward wrote
    #: (running_stats.py) from those it found them at, so a buffer made non-finite by the very first forward
    #: (a VQ codebook's EMA over a dead code) is read at that step, not learnt at the next.
    buffer_versions: dict[int, int] = field(default_factory=dict)

    def infos(self) -> tuple[ModuleInfo, ...]:
        """Every named module's info, as a tuple: a module freed while a caller iterates leaves it whole."""
        return tuple(self.modules.values())

    def info_by_name(self, name: str, model: str | None = None) -> ModuleInfo | None:
        """The info of a watched module by qualified name (first root that has it; ``model``: in that model)."""
        for info in self.infos():
            if info.name == name and (model is None or info.model == model):
                return info
        return None

    def join(self, module: nn.Module, config: WatchConfig) -> ModuleInfo | None:
        """A module called at top level that no root holds: its info once it joins the watch, or None."""
        label = self._new_root_label(module)
        if label is None:
            # ``torch.compile(model)`` of a watched model, called in its place, joins under the model's label, so that
            # the watch steps aside for it as for a compiled target (module_hooks.py): else dynamo traced our global
            # hooks into the model's graph, and raised in them (a symbolic size's nbytes).
            # (Asked of a compiled wrapper only: a ScriptModule's ``_modules`` has no ``get``.)
            original = getattr(module, "_orig_mod", None) if is_compiled(module) else None
            roots = [label for label, root in self.roots if root is original] if original is not None else ()
            if not roots:
                return None
            label = roots[0]
        # A module called at top level becomes a root, named as its own ``named_modules()`` would name it.
        self.add_root(module, label, config)
        return self.modules[id(module)]

    def adopt(self, module: nn.Module, config: WatchConfig) -> ModuleInfo | None:
        """A module called inside a watched call that was not in its model when the watch began: a submodule
        added or swapped in since (``model.append(layer)``, ``model[1] = Log()``) is named now, as
        ``named_modules()`` names it, with its subtree; None for a module no model holds (remembered so)."""
        outside = self.outside.get(id(module))
        if outside is not None and outside() is module:
            return None
        for label, root in self.roots:
            self._name_modules(root, label, config)
        info = self.modules.get(id(module))
        if info is None:
            self.outside[id(module)] = weakref.ref(module)
        return info

    def _new_root_label(self, module: nn.Module) -> str | None:
        if isinstance(module, torch.jit.ScriptModule):
            return None  # TorchScript runs its submodules where no hook sees them (resolve_targets): unwatched
        if self.name_new is not None:
            # A notebook's name for it, which a model the cell rebuilds takes over (``model = Net()``: the name is the
            # new one's now); or its class, numbered: two models in a list have no name and one class.
            label = self.name_new(module)
            if label is None or label != type(module).__name__:
                return label
            return distinct_label(label, [taken for taken, _root in self.roots])
        if not self.discover:
            return None
        original = getattr(module, "_orig_mod", None) if is_compiled(module) else None
        if original is not None and (same := [label for label, root in self.roots if root is original]):
            return same[0]  # ``torch.compile(model)`` of a model that joined: under its label, as join() says why
        # The name the user's code calls it by, else its class (a compiled or DDP model: the class the user wrote),
        # never a label another model joined under (root_labels.py).
        taken = [label for label, _root in self.roots]
        return name_in_callers(module, taken) or distinct_label(user_type(module), taken)

    def admit_optimizer(self, opt: torch.optim.Optimizer) -> bool:
        """Whether an optimizer that is not a target joins the watch (see :attr:`name_new`): also one that steps a
        watched model's parameters, made after the watch began (the loop switched from Adam to SGD); asked once."""
        if self.name_new is not None and self.name_new(opt) is not None:
            self.optimizers.append(opt)
            return True
        refused = self.outside.get(id(opt))
        if refused is not None and refused() is opt:
            return False
        watched = {id(parameter) for _label, root in self.roots for parameter in root.parameters()}
        if any(id(parameter) in watched for group in opt.param_groups for parameter in group["params"]):
            self.optimizers.append(opt)
            return True
        self.outside[id(opt)] = weakref.ref(opt)
        return False

    def add_root(self, module: nn.Module, label: str | None, config: WatchConfig) -> None:
        """Name every submodule of ``module``; modules already named keep their name.

        Names are the user's: the parts a wrapper adds (DDP's ``module.``,
        FSDP's, checkpointing's, ``torch.compile``'s) are left out, here
        and in parameter names (step_checks.py), so ``include``/``exclude``
        patterns and reports use the names of the unwrapped model.
        """
        self.roots.append((label, module))
        self._name_modules(module, label, config)
        for buffer in module.buffers():
            if buffer.is_floating_point() and not buffer.is_inference():
                self.buffer_versions.setdefault(id(buffer), buffer._version)

    def _name_modules(self, module: nn.Module, label: str | None, config: WatchConfig) -> None:
        data_parallel = data_parallel_paths(module)
        any_generator = bool(generators_of(module))  # (one walk: a model holding none asks no submodule)
        for raw_name, submodule in module.named_modules():
            if id(submodule) in self.modules:
                continue
            path = user_path(raw_name, data_parallel)
            name = ".".join(path)
            is_root = submodule is module
            # A module the user picked out by name or type is always checked.
            chosen = bool(config.include or config.types)
            self.modules[id(submodule)] = ModuleInfo(
                name=name,
                module_type=user_type(submodule),
                model=label,
                watched=is_root or _selected(name, submodule, config),
                is_root=is_root,
                transparent=None if is_root or chosen else transparency(submodule),
                deterministic=draws_no_random(submodule),
                compiled=is_compiled(submodule),
                path=path,
                generators=tuple(generators_of(submodule)) if any_generator else (),
            )
            self.named[id(submodule)] = weakref.ref(submodule, self._forget_freed(id(submodule)))

    def _forget_freed(self, key: int) -> Callable[[weakref.ref[nn.Module]], None]:
        def forget(_ref: weakref.ref[nn.Module]) -> None:
            # Runs as the module is freed, before its memory (its id) can be reused.
            self.modules.pop(key, None)
            self.named.pop(key, None)

        return forget


def unmatched_filters(targets: Targets, config: WatchConfig) -> list[tuple[str, str, tuple[str, ...]]]:
    """The ``include`` patterns and ``types`` that match no module the watch named, each as
    ``(option, pattern, what exists)``: the module names, or the type names, the watch did find (the first few)."""
    found: list[tuple[str, str, tuple[str, ...]]] = []
    infos = [info for info in targets.infos() if not info.is_root] or targets.infos()
    names = tuple(info.name for info in infos)
    for pattern in config.include:
        if not any(fnmatch.fnmatchcase(info.name, pattern) for info in targets.infos()):
            found.append(("include", pattern, names[:_SHOWN]))
    if config.types:
        modules = [module for ref in list(targets.named.values()) if (module := ref()) is not None]
        classes = {name for module in modules for name in _type_names(module)}
        for wanted in config.types:
            if wanted not in classes:
                found.append(("types", wanted, tuple(dict.fromkeys(info.module_type for info in infos))[:_SHOWN]))
    return found


#: How many existing names a warning of an unmatched filter shows.
_SHOWN = 5


def _type_names(module: nn.Module) -> set[str]:
    """The names a ``types`` entry can give ``module``'s class by: its own, qualified, and its bases'."""
    cls = type(module)
    return {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"} | {base.__name__ for base in cls.__mro__}


def _selected(name: str, module: nn.Module, config: WatchConfig) -> bool:
    if config.include and not any(fnmatch.fnmatchcase(name, pattern) for pattern in config.include):
        return False
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in config.exclude):
        return False
    if config.types:
        return bool(_type_names(module) & set(config.types))
    return True


def describe(value: Any) -> str:
    """Short description of an object for error messages."""
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _is_grad_scaler(value: Any) -> bool:
    cls_names = {cls.__name__ for cls in type(value).__mro__}
    return "GradScaler" in cls_names and hasattr(value, "get_scale")


def resolve_targets(
    targets: Iterable[Any],
    labels: Iterable[str | None] | None,
    config: WatchConfig,
    name_new: Callable[[Any], str | None] | None = None,
) -> Targets:
    """Sort targets into modules, optimizers and scalers; refuse anything else.

    ``name_new`` names what joins the watch later (:attr:`Targets.name_new`).

    Raises
    ------
    TypeError
        For an object that is not a module, optimizer or GradScaler.
    """
    targets = list(targets)
    label_list: list[str | None] = list(labels) if labels is not None else [None] * len(targets)
    if len(label_list) != len(targets):
        raise ValueError(f"got {len(label_list)} labels for {len(targets)} targets")
    label_list = _default_model_labels(targets, label_list)
    resolved = Targets(name_new=name_new)
    for target, label in zip(targets, label_list):
        shown = label or type(target).__name__
        if isinstance(target, torch.jit.ScriptModule):
            raise TypeError(
                f"cannot watch {shown} ({describe(target)}): TorchScript runs its submodules where no hook "
                "sees them; watch the module before torch.jit.script or trace (or compile it with torch.compile)"
            )
        if isinstance(target, nn.Module):
            resolved.add_root(target, label, config)
        elif isinstance(target, torch.optim.Optimizer):
            resolved.optimizers.append(target)
        elif _is_grad_scaler(target):
            resolved.scalers.append(target)
        else:
            # A list of models is the likeliest slip (targets are separate arguments): say how to pass one.
            spread = ("; give its items one by one: watch(model, opt), %%nantrace model, opt"
                      if isinstance(target, (list, tuple)) else "")
            raise TypeError(
                f"cannot watch {shown} ({describe(target)}): expected an nn.Module, "
                f"a torch.optim.Optimizer or a GradScaler{spread}"
            )
    resolved.discover = not resolved.roots
    return resolved


def _default_model_labels(targets: list[Any], labels: list[str | None]) -> list[str | None]:
    """Several models given without labels are labelled by their class: a report then says which it means.

    A DCGAN's generator and discriminator both have ``main.0``; two models of
    one class are told apart by their position (``Encoder#1``, ``Encoder#2``).
    """
    models = [index for index, target in enumerate(targets) if isinstance(target, nn.Module)]
    if len(models) < 2:
        return labels
    names = {index: user_type(targets[index]) for index in models if labels[index] is None}  # (DDP: the class held)
    taken = Counter(label for label in labels if label is not None)
    repeated = Counter(names.values())
    result = list(labels)
    seen: Counter[str] = Counter()
    for index, name in names.items():
        seen[name] += 1
        label = f"{name}#{seen[name]}" if repeated[name] > 1 or taken[name] else name
        result[index] = label
    return result
