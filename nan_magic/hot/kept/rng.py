"""The state a module call ran in, kept so that a replay draws the same random numbers.

The hot path takes it before each watched call that may draw random numbers
(deterministic.py says which do not), so both reads are a few flag and
state reads; a replay (localize/) sets it back around the call it re-runs.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from nan_magic.hot.kept.generators import GeneratorStates, UserDraws
from nan_magic.hot.watched.deterministic import draws_no_random

__all__ = [
    "AutocastState",
    "ModelStates",
    "RngState",
    "any_autocast",
    "capture_autocast",
    "capture_rng_state",
    "generators_at",
    "restore_rng_state",
]


class RngState(NamedTuple):
    """The default generators' states: CPU, and each CUDA device's if CUDA is in use.

    A named tuple: one is made per watched module call, so it must be cheap.
    """

    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None = None
    #: The user's own generators the call may draw from, each with its state (generators.py); mostly none.
    others: GeneratorStates = ()


#: torch.cuda's private initialised flag, where it has one (None: it is not read).
_CUDA_FLAG = getattr(torch.cuda, "_initialized", None)
_new_tuple = tuple.__new__

#: The autocast regions a call ran in, as ``((device_type, dtype), ...)``.
AutocastState = tuple[tuple[str, torch.dtype], ...]

#: Device types whose autocast state a call records.
_AUTOCAST_DEVICES = ("cuda", "cpu")


def capture_rng_state() -> RngState:
    """The state of the default CPU and CUDA generators, to replay a call with.

    CUDA is only asked when it is already initialised: capturing must not
    start a CUDA context in a CPU-only program.
    """
    cuda = None
    # The module's flag, then is_initialized() (also False in a forked child), then is_available(): a CPU-only
    # program reads one attribute here (hot path).
    if (_CUDA_FLAG is None or torch.cuda._initialized) and torch.cuda.is_initialized() and torch.cuda.is_available():
        cuda = tuple(torch.cuda.get_rng_state_all())
    # (torch.get_rng_state(), one frame less; tuple.__new__: the named tuple's own __new__ is a Python call more)
    return _new_tuple(RngState, (torch.default_generator.get_state(), cuda, ()))


class ModelStates:
    """The generators' state at each top-level call of a model, for its step replay (replay/tiered/step.py's begin).

    Taken at every call (a new 5 KB tensor: 13 us in a deep_mlp step, 0.7 us alone), except for an exact
    ``nn.Sequential`` of torch leaf modules that draw no random number (deterministic.py): its calls draw none,
    so any state replays them, and the first one taken is given again while its children stay the same objects
    (a swap, ``model[1] = nn.Dropout()``, or an append takes it anew). A forward hook of the user's on it or a
    child may draw, so it takes one each call; hooks are looked at with the children, so one registered later
    is seen only once a child changes. Held per model, weakly.
    """

    def __init__(self) -> None:
        #: Per Sequential, by id: a weak reference to it, its children when last called, and the state it is given
        #: again (None: it may draw). A dict by id, not a WeakKeyDictionary: its ``get`` is a Python call that makes
        #: a weak reference at each call (every top-level call); the entry goes as the Sequential does.
        self._kept: dict[int, tuple[weakref.ref[nn.Module], tuple[nn.Module | None, ...], RngState | None]] = {}

    def take(self, module: nn.Module) -> RngState:
        """The state to replay this call of ``module`` from."""
        if type(module) is not nn.Sequential:  # (a model with a forward of its own: taken at every call)
            return capture_rng_state()
        kept, children = self._kept.get(id(module)), tuple(module._modules.values())
        if kept is not None and kept[1] == children and kept[0]() is module:  # (the same children: it draws as it
            return kept[2] or capture_rng_state()  # did, or not)
        rng = capture_rng_state()
        # (A user's forward hook on it or a child may draw: ``x + noise`` in a pre-hook. Asked as the children are.)
        draws = _hooked(module) or not all(
            child is not None and draws_no_random(child) and not _hooked(child) for child in children)
        key, by_id = id(module), self._kept
        by_id[key] = (weakref.ref(module, lambda _gone: by_id.pop(key, None)), children, None if draws else rng)
        return rng


def _hooked(module: nn.Module) -> bool:
    """Whether ``module`` has a forward hook or pre-hook of the user's (the watch's own, on a root, draw none)."""
    hooks = (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
    return any(not getattr(hook, "__module__", "").startswith("nan_magic.") for hook in hooks)


def capture_autocast() -> AutocastState | None:
    """The autocast regions active now, or None (the hot path: one flag read).

    A replay that runs later than the call (a backward producer's, from its
    gradient hook; any producer's, at the deferred check) runs after the
    user's ``torch.autocast`` block exited: without this, a float16 overflow
    of an autocast matmul would be replayed in float32 and not reproduce.
    """
    if not (_ANY_AUTOCAST() if _ANY_AUTOCAST is not None else _any_autocast()):
        return None
    return tuple(
        (device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES if torch.is_autocast_enabled(device)
    ) or None


#: Whether any autocast region is active: torch's private flag, one call (where it has none: _any_autocast).
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def _any_autocast() -> bool:
    return any(torch.is_autocast_enabled(device) for device in _AUTOCAST_DEVICES)


#: Whether any autocast region is active, asked before :func:`capture_autocast` where a call is the hot path.
any_autocast = _ANY_AUTOCAST if _ANY_AUTOCAST is not None else _any_autocast


def restore_rng_state(state: RngState) -> None:
    """Set the default generators back to ``state``."""
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(list(state.cuda))


@contextlib.contextmanager
def generators_at(state: RngState | None) -> Iterator[UserDraws]:
    """The default generators at ``state`` (as they are, for None) for the duration; the user's put back after.

    The user's own generators too (generators.py): those ``state`` kept start from their kept states, and every one
    drawn from is put back; the mode it yields lists those drawn from whose state was not kept.
    """
    user = capture_rng_state()
    try:
        if state is not None:
            restore_rng_state(state)
        with UserDraws(state.others if state is not None else ()) as draws:
            yield draws
    finally:
        restore_rng_state(user)
