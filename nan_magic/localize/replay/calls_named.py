"""Finding calls in a step's log by module name: the caller named in an op finding, and whether a call can be replayed.

Read by the single-call replays (producer_call.py, call_backward.py), the outward replay (outward.py) and the
producer rule (producer.py); apart from :mod:`~nan_magic.localize.replay.producer_call` because they read only the
log's call tree, never run anything.
"""

from __future__ import annotations

from torch import nn

from nan_magic.hot.kept.call_records import Call
from nan_magic.hot.kept.rng import RngState
from nan_magic.hot.kept.step_log import StepLog
from nan_magic.hot.watched.transparent import transparency
from nan_magic.localize.replay.module_run import (
    submodule_names,
)
from nan_magic.records import Phase

__all__ = ["caller_named", "run_without_a_call"]


def _call_named(log: StepLog, call: Call, module: str | None) -> Call | None:
    """The latest call of the module named ``module`` made inside ``call`` (a child's code ran the op), if any."""
    for inner in reversed(log.calls):
        if inner.phase == Phase.FORWARD and inner.name == module and inner is not call:
            outer = inner.parent
            while outer is not None and outer is not call:
                outer = outer.parent
            if outer is call:
                return inner
    return None


def run_without_a_call(module: nn.Module, module_name: str | None, op_module: str | None) -> nn.Module | None:
    """The submodule named ``op_module`` in a replay of ``module``, where its own code ran the op with no call of it.

    Asked where the log has no call of ``op_module`` inside ``module``'s. A child whose ``forward`` (or another
    method) its parent called directly (``self.act.forward(h)``) runs no hook: the tracer names it by the op's
    frames (ops/owners.called_directly), and PRODUCT.md's module is it. A pass-through child (transparent.py) has
    no call either, though it was called: it stays the parent's, with a note (None).
    """
    if op_module is None or op_module == module_name:
        return None
    for sub_id, name in submodule_names(module, module_name or "").items():
        if name == op_module:
            sub = next(sub for sub in module.modules() if id(sub) == sub_id)
            return sub if transparency(sub) is None else None
    return None


def caller_named(call: Call, module: str | None) -> Call | None:
    """The call enclosing ``call`` (not ``call`` itself) of the module named ``module``, if any."""
    caller = call.parent
    while caller is not None:
        if caller.name == module:
            return caller
        caller = caller.parent
    return None


def _within(module: str | None, producer: Call, enclosing: Call) -> bool:
    """Whether the module named ``module`` in a replay of ``enclosing`` is ``producer``'s or one of its submodules.

    By the modules themselves: the replay's names of those in ``producer``'s tree.
    """
    if module is None:
        return False
    names = submodule_names(enclosing.module, enclosing.name or "")
    return module in {names.get(id(sub)) for sub in producer.module.modules()}


def _replayable(call: Call, rng_state: RngState | None) -> bool:
    """Whether the call's RNG state is known: saved, or not needed (the module draws no random numbers)."""
    return rng_state is not None or (call.info is not None and call.info.deterministic)
