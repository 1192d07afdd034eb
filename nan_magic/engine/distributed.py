"""Many processes: which rank a report comes from, and every rank stopping at one rank's event.

Under ``torch.distributed`` (DDP, FSDP, ``torchrun``) each rank runs its own
watch. A rank that raises alone leaves the others waiting in a collective.
What gloo does then (measured on torch 2.13, CPU, see the test file
``tests/test_distributed.py``):

* the failing rank raises and its process exits: the others get
  "Connection closed by peer" from their pending collective within about
  two seconds; no hang, but an error that names nothing;
* the failing rank raises and stays alive (``try/except``, a notebook): the
  others wait in DDP's gradient all-reduce until the process-group timeout;
* the failing rank issues a one-element all-reduce while the others are in
  DDP's bucket all-reduce: gloo aborts the process (``gloo::EnforceNotMet``,
  SIGABRT). An agreement collective may therefore only be issued at a point
  where no rank has a DDP collective pending.

So the agreement happens at the optimizer step's pre-hook, which every rank
reaches after backward (DDP's all-reduce is complete) and before the step.
Under a process group the watch defers its checks (``defer=True``, see
:func:`launched`): every event of a step, data, forward, loss and backward,
is judged at that hook, in the one host read it already makes. There each
rank takes part in exactly one all-reduce (MAX) of a one-element integer
that encodes which rank found the most telling event (see :meth:`Agreement.settle`).
A rank that found one first puts its pickled report in the process group's
store, so the others can name it. Where no process group exists, the cost is
one ``is_initialized()`` call per optimizer step.

Covered: a real event of any phase judged at a step's check, in ``raise``
mode, in a loop where every rank of the default group calls
``optimizer.step()``, whether the failing rank then exits or stays alive.
Not covered (the failing rank raises alone; its peers get gloo's "Connection
closed by peer" if it exits, or wait until the timeout if it stays alive): an
event judged outside a step's check (a backward without a step: gradient
accumulation, a GradScaler's skipped step, inference; the last step's
parameter check at the watch's exit), ``defer=False`` given explicitly
(checks raise mid-forward), and any other exception on one rank.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from nan_magic.engine.errors import NonFiniteError, PeerNonFiniteError
from nan_magic.records import Phase, Report

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterable

    from nan_magic.engine.findings import Finding

__all__ = [
    "Agreement", "data_parallel_paths", "launched", "launched_rank", "leave_together", "local_shard", "per_rank_path",
    "process_group", "stamp", "unflattened_name", "user_name", "user_type",
]

#: Attributes under which wrappers hold the user's module: never part of the user's names.
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})

#: The attribute under which FSDP1 (``use_orig_params=False``) registers a wrapped module's FlatParameter.
_FLAT_PARAM = "_flat_param"

_FSDP_MODULE: type | None
try:
    from torch.distributed.fsdp import FSDPModule

    _FSDP_MODULE = FSDPModule
except ImportError:  # pragma: no cover - a torch without FSDP2
    _FSDP_MODULE = None

_DATA_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)

#: How telling a rank's event is: a producer on that rank beats a non-finite
#: parameter gradient seen at the step, which may have arrived through DDP's all-reduce.
_PRODUCED, _ARRIVED = 2, 1

_KEY = "nan_magic/event/{round}/{rank}"
_LEAVING = "nan_magic/leaving"


def data_parallel_paths(root: nn.Module) -> frozenset[str]:
    """Qualified names of the DDP / DataParallel wrappers in ``root``, whose ``module`` child is not the user's."""
    return frozenset(name for name, sub in root.named_modules() if isinstance(sub, _DATA_PARALLEL))


def user_type(module: nn.Module) -> str:
    """The user's class name: that of the module a wrapper holds (DDP, FSDP1, checkpointing), without FSDP2's prefix."""
    while True:
        children = module._modules  # a dict lookup: no AttributeError raised per module of a large model
        inner = children.get("module") if isinstance(module, _DATA_PARALLEL) else None
        for part in _WRAPPER_PARTS:
            inner = inner or children.get(part)
        if not isinstance(inner, nn.Module):
            break
        module = inner
    cls: type = type(module)
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
    kept: list[str] = []
    path = ""
    for part in name.split("."):
        wrapper_part = part in _WRAPPER_PARTS or (part == "module" and path in data_parallel)
        path = f"{path}.{part}" if path else part
        if not wrapper_part:
            kept.append(part)
    return ".".join(kept)


def unflattened_name(name: str, roots: Iterable[nn.Module], values: torch.Tensor | None) -> str:
    """The user's parameter that ``name``, an FSDP1 flat parameter, holds the first non-finite element of ``values`` in.

    Under ``use_orig_params=False`` the optimizer steps FlatParameters, each
    this rank's shard of the concatenated parameters of one wrapped module,
    registered as ``_flat_param``: a name the user never wrote (``1._flat_param``
    -> ``1.lin.bias``). ``values`` (its gradient, the parameter itself or an
    optimizer state) is laid out like the shard, so the element's offset says
    whose it is. Any other name, or a finite ``values``, is returned
    unchanged. Walks the models: called per finding, never per step.
    """
    owner, _dot, last = name.rpartition(".")
    if last != _FLAT_PARAM or values is None:
        return name
    for root in roots:
        data_parallel = data_parallel_paths(root)
        for raw_name, parameter in root.named_parameters():
            if user_name(raw_name, data_parallel) == name:
                part = _flat_part(parameter, values)
                if part is None:
                    return name
                return f"{owner}.{part}" if owner else part
    return name


def _flat_part(flat: torch.Tensor, values: torch.Tensor) -> str | None:
    """The name, relative to its wrapped module, of the parameter whose part of ``flat``'s shard is first non-finite."""
    fqns = getattr(flat, "_fqns", None)
    infos = getattr(flat, "_shard_param_infos", None)  # one per parameter: is it in this rank's shard, and where
    if fqns is None or infos is None or values.shape != flat.shape:
        return None
    bad = torch.nonzero(~torch.isfinite(values.detach().reshape(-1)))
    if bad.numel() == 0:
        return None
    index = int(bad[0, 0])
    for fqn, info in zip(fqns, infos):
        if info.in_shard and info.offset_in_shard <= index < info.offset_in_shard + info.numel_in_shard:
            return str(fqn)
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


class Agreement:
    """One watch's part in the per-step agreement (see the module docstring).

    :meth:`open` marks the optimizer step's pre-hook (the agreement point);
    :meth:`settle` takes part in its one collective, once.
    """

    def __init__(self) -> None:
        self._open = False
        # Every rank takes part in the same collectives in the same order, so
        # this count names the same round on every rank (store keys).
        self._round = 0

    def open(self) -> None:
        group = process_group()
        self._open = group is not None and group[1] > 1

    def close(self) -> None:
        self._open = False

    def settle(self, own: NonFiniteError | None, finding: Finding | None = None) -> NonFiniteError | None:
        """The error this rank raises: its own, a peer's (:class:`PeerNonFiniteError`), or None.

        Outside the agreement point (or outside a process group) ``own`` is
        returned unchanged: a collective issued where a peer may be inside
        DDP's all-reduce would abort both processes.
        """
        if not self._open:
            return own
        self._open = False
        rank, world = process_group() or (0, 1)
        round_, self._round = self._round, self._round + 1
        store = dist.distributed_c10d._get_default_store()
        flag = 0
        if own is not None:
            # Put the report where the others can read it before they learn there is one to read.
            store.set(_KEY.format(round=round_, rank=rank), pickle.dumps(own.report))  # type: ignore[arg-type] # the store keeps bytes
            arrived = finding is not None and finding.call is None and finding.phase == Phase.BACKWARD
            flag = (_ARRIVED if arrived else _PRODUCED) * world + (world - 1 - rank)
        agreed = torch.tensor([flag], dtype=torch.int64, device=_flag_device())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        value = int(agreed.item())
        if value == 0:
            return None
        first = world - 1 - value % world
        error = own
        if first != rank:
            report: Report = pickle.loads(store.get(_KEY.format(round=round_, rank=first)))
            error = PeerNonFiniteError(_as_seen_here(report, own, rank), local_report=own.report if own else None)
        # Only when stopping: wait until every rank has read the report, so that the rank
        # that serves the store (rank 0 under torchrun) does not exit before the others have it.
        dist.all_reduce(torch.zeros(1, dtype=torch.int64, device=agreed.device))
        return error


def _flag_device() -> torch.device:
    """Where the flag must live for the default group's backend: NCCL alone reduces only CUDA tensors."""
    backend = str(dist.get_backend())
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _as_seen_here(report: Report, own: NonFiniteError | None, rank: int) -> Report:
    """The producing rank's report, with a note of how the event reached this rank."""
    if own is not None and own.report.phase == Phase.BACKWARD:
        note = (f"rank {rank} received it through the gradient all-reduce (or FSDP's reduce-scatter) "
                f"(its own first non-finite value: {own.report.tensor})")
    elif own is not None:
        note = f"rank {rank} also saw a non-finite value: {own.report.message}"
    else:
        note = f"rank {rank} saw no non-finite value of its own at this step"
    return dataclasses.replace(report, notes=(*report.notes, note))
