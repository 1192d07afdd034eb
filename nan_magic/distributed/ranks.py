"""Many processes: which rank a report comes from, and the user's names of a wrapped model.

Under ``torch.distributed`` each rank runs its own watch. This module says
which rank that is, names modules and parameters as the user does (without
the parts DDP, FSDP, checkpointing and ``torch.compile`` add), and gives
output files a per-rank suffix. How the ranks stop together: agreement.py.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from nan_magic.records import Report

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterable

__all__ = [
    "ParameterPlace", "data_parallel_paths", "is_sharded", "launched", "launched_rank", "leave_together", "local_shard",
    "parameter_place", "per_rank_path", "process_group", "qualified", "stamp", "user_name", "user_path", "user_type",
]

#: Attributes under which wrappers hold the user's module: never part of the user's names.
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})

_FSDP_MODULE: type | None
try:
    from torch.distributed.fsdp import FSDPModule

    _FSDP_MODULE = FSDPModule
except ImportError:  # pragma: no cover - a torch without FSDP2
    _FSDP_MODULE = None

_SHARDED: tuple[type, ...]
try:
    from torch.distributed.fsdp import FullyShardedDataParallel

    _SHARDED = (FullyShardedDataParallel, *([_FSDP_MODULE] if _FSDP_MODULE is not None else []))
except ImportError:  # pragma: no cover - a torch without FSDP1
    _SHARDED = (_FSDP_MODULE,) if _FSDP_MODULE is not None else ()

_DATA_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)

_LEAVING = "nan_magic/leaving"


def is_sharded(root: nn.Module) -> bool:
    """Whether ``root`` holds a module sharded by FSDP (``FullyShardedDataParallel`` or ``fully_shard``).

    Its forward gathers parameters with collectives every rank joins: it
    cannot run again on one rank alone (a replay), and its ranks run in step.
    """
    return bool(_SHARDED) and any(isinstance(module, _SHARDED) for module in root.modules())


def data_parallel_paths(root: nn.Module) -> frozenset[str]:
    """Qualified names of the DDP / DataParallel wrappers in ``root``, whose ``module`` child is not the user's."""
    return frozenset(name for name, sub in root.named_modules() if isinstance(sub, _DATA_PARALLEL))


def user_type(module: nn.Module) -> str:
    """The user's class name: that of the module a wrapper holds (DDP, FSDP1, checkpointing), without FSDP2's prefix,
    and the class a TorchScript module was compiled from."""
    while True:
        # A dict lookup: no AttributeError raised per module of a large model (``in`` first: a scripted
        # module's OrderedModuleDict has no ``get``).
        children = module._modules
        inner = children["module"] if isinstance(module, _DATA_PARALLEL) and "module" in children else None
        for part in _WRAPPER_PARTS:
            inner = inner or (children[part] if part in children else None)  # noqa: SIM401 (no get: see above)
        if not isinstance(inner, nn.Module):
            break
        module = inner
    cls: type = type(module)
    if issubclass(cls, torch.jit.ScriptModule):
        # torch.jit.script / trace compile the user's class into RecursiveScriptModule / TracedModule: its name kept.
        return str(module.original_name)
    if _FSDP_MODULE is not None and issubclass(cls, _FSDP_MODULE):
        # fully_shard swaps the class for FSDP<Name>(FSDPModule, <Name>): the user's class is the next one.
        cls = next(base for base in cls.__mro__ if not issubclass(base, _FSDP_MODULE))
    return cls.__name__


def user_name(name: str, data_parallel: frozenset[str] = frozenset()) -> str:
    """A qualified module or parameter name without the parts wrappers add.

    ``module.1.weight`` -> ``1.weight`` when ``""`` (the root) is a DDP
    wrapper (``data_parallel``, see :func:`data_parallel_paths`); FSDP's,
    checkpointing's and ``torch.compile``'s parts always go. A user's own
    submodule called ``module`` keeps its name.
    """
    if not data_parallel and not any(part in name for part in _WRAPPER_PARTS):
        return name  # the common case: no split, no join
    return ".".join(user_path(name, data_parallel))


def user_path(name: str, data_parallel: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """:func:`user_name` as the names from the root down: ``("blocks", "0", "attn")``; ``()`` for the root.

    ``name`` is torch's qualified name (``named_modules``), which joins its
    children's names with dots: torch refuses a child's name that holds one,
    so the parts are exactly the names.
    """
    kept: list[str] = []
    path = ""
    for part in name.split(".") if name else ():
        wrapper_part = part in _WRAPPER_PARTS or (part == "module" and path in data_parallel)
        path = f"{path}.{part}" if path else part
        if not wrapper_part:
            kept.append(part)
    return tuple(kept)


@dataclass(frozen=True)
class ParameterPlace:
    """Where a parameter sits in the user's model: its qualified name and the module that holds it (user's names)."""

    #: The parameter's qualified name (``block.0.attn.w``).
    name: str
    #: The qualified name of the module it is registered on (``block.0.attn``; ``""``: the root).
    module: str


def parameter_place(name: str, roots: Iterable[nn.Module], values: torch.Tensor | None) -> ParameterPlace | None:
    """Where the parameter the watch names ``name`` sits, found by walking the models' modules (None: in none).

    The owner comes from the module the parameter is registered on, never
    from the name. An FSDP1 flat parameter (``use_orig_params=False``: the
    optimizer steps FlatParameters, each this rank's shard of the concatenated
    parameters of one wrapped module, registered as ``_flat_param``, a name
    the user never wrote) is placed as the user's parameter holding the first
    non-finite element of ``values`` (its gradient, the parameter itself or an
    optimizer state, laid out like the shard): ``1._flat_param`` ->
    ``1.lin.bias`` in module ``1.lin``. Its padding, or a finite ``values``,
    leaves the flat parameter itself. Walks the models: called per finding,
    never per step.
    """
    for root in roots:
        data_parallel = data_parallel_paths(root)
        seen: set[int] = set()  # named_parameters()' rule: a shared parameter has its first name
        for raw_module, module in root.named_modules():
            owner = user_name(raw_module, data_parallel)
            for leaf, parameter in module.named_parameters(recurse=False):
                if id(parameter) in seen:
                    continue
                seen.add(id(parameter))
                if qualified(owner, leaf) == name:
                    inner = _flat_part(parameter, values) if values is not None else None
                    if inner is None:
                        return ParameterPlace(name, owner)
                    inner_module, inner_name = inner
                    module_name = user_name(qualified(raw_module, inner_module), data_parallel)
                    return ParameterPlace(qualified(module_name, inner_name), module_name)
    return None


def qualified(module: str, name: str) -> str:
    """A qualified name, as torch's ``named_modules`` writes one: ``module.name``, ``name`` under the root, and
    ``module`` itself for its own (empty) name."""
    return f"{module}.{name}" if module and name else module or name


def _flat_part(flat: torch.Tensor, values: torch.Tensor) -> tuple[str, str] | None:
    """Its module's name within the wrapped module, and its own name, of the parameter whose part of ``flat``'s
    shard is first non-finite (FSDP's ``ParamInfo``); None for another parameter, a finite ``values`` or padding."""
    parts = getattr(flat, "_param_infos", None)
    infos = getattr(flat, "_shard_param_infos", None)  # one per parameter: is it in this rank's shard, and where
    if parts is None or infos is None or values.shape != flat.shape:
        return None
    bad = torch.nonzero(~torch.isfinite(values.detach().reshape(-1)))
    if bad.numel() == 0:
        return None
    index = int(bad[0, 0])
    for part, info in zip(parts, infos):
        if info.in_shard and info.offset_in_shard <= index < info.offset_in_shard + info.numel_in_shard:
            return part.module_name, part.param_name
    return None  # the shard's padding


def local_shard(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a DTensor (FSDP2's sharded gradients), else the tensor itself.

    Checked locally: no collective, and indexing a DTensor (the report's
    statistics) has no sharding rule.
    """
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def process_group() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the default process group, or None where none is initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


def launched_rank() -> int:
    """This process's rank as ``torchrun`` set it in the environment (0 when it did not)."""
    return int(os.environ.get("RANK", "0") or 0)


def launched() -> bool:
    """Whether this process is one of several ranks (a process group, or ``torchrun``'s environment)."""
    group = process_group()
    if group is not None:
        return group[1] > 1
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def stamp(report: Report) -> Report:
    """The report with this process's rank and world size (unchanged outside a process group)."""
    group = process_group()
    if group is None:
        return report
    return dataclasses.replace(report, rank=group[0], world_size=group[1])


def per_rank_path(path: str) -> str:
    """``path`` with a ``.rankN`` suffix before its extension when several ranks run, so none overwrites another.

    ``report.json`` -> ``report.rank1.json``; the dump's scene files get it too, in the one folder.
    """
    group = process_group()
    if group is None and launched():
        group = launched_rank(), int(os.environ["WORLD_SIZE"])
    if group is None or group[1] <= 1:
        return path
    root, extension = os.path.splitext(path)
    return f"{root}.rank{group[0]}{extension}"


def leave_together(timeout_s: float = 10.0) -> None:
    """Wait, at most ``timeout_s``, until every rank has called this (a no-op outside a process group).

    Through the store, not a collective: a rank that stopped elsewhere (its
    script's own error) must cost the others this timeout, not a hang.
    """
    group = process_group()
    if group is None:
        return
    store = dist.distributed_c10d._get_default_store()
    store.add(_LEAVING, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(_LEAVING, 0) < group[1] and time.monotonic() < deadline:
        time.sleep(0.02)
