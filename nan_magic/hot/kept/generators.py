"""The user's own ``torch.Generator`` objects a model draws from, kept so that a replay draws the same numbers.

A forward may draw from a generator of its own: ``torch.randn(..., generator=self.gen)``, a noise layer, a diffusion
model's noise, a stochastic depth with its own generator. A replay of such a call (replay/tiered/root_calls.py,
replay/module_run.py) must start each from the state it had when the call began, and leave it where the user's run
left it: the default generators' states (rng.py) do not cover it.

Which generators a call keeps (the hot path: nothing for a model that holds none):

* those a model or its submodules hold as attributes, found once at the model's first call
  (deterministic.generators_of);
* a generator passed as a positional argument of the call (``model(x, g)``);
* one passed by keyword (``model(x, generator=g)``; a pre-hook sees no keyword argument): learned as the call
  returns, kept from the model's next call on;
* those a replay of one of its calls found it drawing from (a global or a closure's generator): learned then, kept
  from the model's next call on (``UserDraws.unkept``).

A generator the first call drew from that was not kept (a keyword argument's, a global's): its replay says so.

A replay runs under :class:`UserDraws` (entered by rng.generators_at): the kept generators are set to their states
at the call, and any generator an op draws from has its state saved before its first draw; all are put back after.
A generator drawn from whose state was not kept is listed: the replay drew other numbers than the call did, and its
report says so (Note ``generator-not-kept``) rather than name what those numbers made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nan_magic.hot.watched.deterministic import generator_key

__all__ = ["GeneratorStates", "UserDraws", "states_of", "with_user_generator"]

#: ``(generator, its state)`` for each user generator a call keeps (an empty tuple for almost every model).
GeneratorStates = tuple[tuple[torch.Generator, torch.Tensor], ...]


def states_of(generators: Sequence[torch.Generator]) -> GeneratorStates:
    """Each generator with its state now (a call begins)."""
    return tuple((generator, generator.get_state()) for generator in generators)


def with_user_generator(state: Any, keyword: torch.Generator | None, args: Sequence[Any]) -> Any:
    """``state`` (an RngState) with the user's generator a random op of the loop's code is about to draw from
    (``torch.randint(..., generator=g)`` in the loss code: outside/recorder.py), at its state now, where the state
    keeps none of it yet (its first draw of the region) and it is not a default generator (``state`` has those)."""
    kept = {generator_key(generator) for generator, _state in state.others} | _defaults()
    found = [generator for generator in (keyword, *args) if type(generator) is torch.Generator]
    fresh = [generator for generator in found if generator_key(generator) not in kept]
    return state._replace(others=(*state.others, *states_of(fresh))) if fresh else state


def _defaults() -> set[int]:
    """The default generators, which rng.generators_at sets and puts back itself (CUDA's where it is started)."""
    found = {generator_key(torch.default_generator)}
    if getattr(torch.cuda, "_initialized", False):
        found.update(generator_key(generator) for generator in torch.cuda.default_generators)
    return found


#: The generators a replay's :class:`UserDraws` has set (by ``_cdata``: how many of them, nested): an op an inner one
#: runs passes through the outer ones too, where the generator is at the inner one's kept state, not the user's, and
#: not drawn unkept: the outer ones leave it to the inner one (a loss-code trial inside a step's replay, fixes/).
_SET_BY_A_REPLAY: dict[int, int] = {}


class UserDraws(TorchDispatchMode):
    """A replay's draws from the user's own generators: from their kept states, the user's put back after.

    Below autograd, as the op tracer: the generator of a random op is its ``generator`` keyword argument there (a
    new Python object for the same generator: matched by ``_cdata``).
    """

    def __init__(self, kept: GeneratorStates) -> None:
        super().__init__()
        self._kept = kept
        #: By ``_cdata``: each generator the replay set or drew from, with the user's state to put back.
        self._user: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self._defaults: set[int] = set()
        #: Generators drawn from whose state at the call was not kept (the replay drew other numbers).
        self.unkept: list[torch.Generator] = []

    def __enter__(self) -> UserDraws:
        self._defaults = _defaults()
        for generator, state in self._kept:
            key = generator_key(generator)
            if key not in self._user:
                self._take(key, generator)
            generator.set_state(state)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for key, (generator, state) in self._user.items():
                generator.set_state(state)
                if (held := _SET_BY_A_REPLAY[key] - 1) > 0:
                    _SET_BY_A_REPLAY[key] = held
                else:
                    del _SET_BY_A_REPLAY[key]

    def _take(self, key: int, generator: torch.Generator) -> None:
        self._user[key] = (generator, generator.get_state())
        _SET_BY_A_REPLAY[key] = _SET_BY_A_REPLAY.get(key, 0) + 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        # The generator is a keyword argument of most random ops, positional in a few schemas (poisson, binomial,
        # _standard_gamma, _sample_dirichlet): both, at an event only.
        for generator in (kwargs.get("generator"), *(arg for arg in args if type(arg) is torch.Generator)):
            if generator is not None and (key := generator_key(generator)) not in self._user and (
                    key not in self._defaults) and key not in _SET_BY_A_REPLAY:
                self._take(key, generator)
                self.unkept.append(generator)
        return func(*args, **kwargs)
