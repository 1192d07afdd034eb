"""A replay leaves no trace on the user's model, whatever its forward does to it.

A replay runs the user's forward once more (replay/tiered/step.py, replay/module_run.py). Its
buffers are swapped for copies (``replay.swapped_buffers``); what else a
forward may change is put back here:

* tensors it writes in place: parameters (a max-norm ``clamp_``, an EMA kept
  in a frozen parameter) and tensors the modules hold as plain attributes or
  in a list, tuple or dict attribute (a cache filled in place). Copy-on-write,
  nothing is copied up front: the op tracer calls :meth:`ModelGuard.before_write`
  ahead of every op that writes a tensor, and the storage about to change is
  saved once, then written back bit for bit;
* the modules' Python state: an attribute rebound (a call counter, the last
  attention map kept for plotting) and the contents of a list, dict, set or
  deque attribute (a cache appended to), as they were when the replay began;
* Python's and numpy's global random generators (:func:`user_generators`), which a forward may draw from (a
  stochastic depth by ``random.random()``): a replay must not move the user's run onto other random numbers;
* the cache of ``torch.nn.utils.parametrize.cached()`` (:func:`uncached_parametrizations`): a replay run inside
  the user's ``with parametrize.cached():`` would read the parametrized weights the cache holds, computed before
  the replay, and never run the parametrization that made them non-finite (the Linear would be named, not its
  parametrization); nor may it leave weights of its own in the user's cache.

Not covered: a tensor that a container holds inside another container, and
``param.data = ...``, which rebinds a parameter's storage without an op.

The arguments are copied when they are tensors or containers of tensors (replay/module_run.py), but an object
passed as an argument is the user's: a Hugging Face ``DynamicCache`` that each attention layer appends its keys
to. :func:`arguments_untouched` puts back what a replay rebinds on such an object (and on the objects its list
and dict attributes hold: the cache's layers), and says whether it rebound anything: then the call it replays
had changed that object too, the replay started from its state *after* the call, and its finding is not the call's.
"""

from __future__ import annotations

import collections
import contextlib
import random
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["ArgumentGuard", "ModelGuard", "arguments_untouched", "untouched", "user_generators"]

#: Containers whose contents are put back in place (their identity is the user's).
_CONTAINERS = (list, dict, set, collections.deque)


class ModelGuard:
    """What a module tree was when a replay began, to put it back after (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        modules = list(model.modules())
        self._attributes = [(module, dict(module.__dict__)) for module in modules]
        self._contents: list[tuple[Any, Any]] = [
            (value, _contents(value))
            for _module, attributes in self._attributes
            for value in attributes.values()
            if isinstance(value, _CONTAINERS)
        ]
        held: list[torch.Tensor | None] = [parameter for module in modules for parameter in module._parameters.values()]
        held += [tensor for _module, attributes in self._attributes for tensor in _tensors_in(attributes.values())]
        self._storages: dict[tuple[str, int], torch.UntypedStorage] = {}
        for tensor in held:
            if tensor is not None and tensor.numel():
                storage = _storage_of(tensor)
                if storage is not None:
                    self._storages.setdefault((storage.device.type, storage.data_ptr()), storage)
        self._saved: dict[tuple[str, int], torch.UntypedStorage] = {}

    def before_write(self, tensor: torch.Tensor) -> None:
        """An op is about to write ``tensor``: save its storage first if it is the model's."""
        storage = _storage_of(tensor)
        if storage is None:
            return
        key = (storage.device.type, storage.data_ptr())  # two devices may use one address
        if key in self._storages and key not in self._saved:
            self._saved[key] = self._storages[key].clone()

    def restore(self) -> None:
        """Put back the tensors written and the Python state changed since the guard began."""
        for key, saved in self._saved.items():
            self._storages[key].copy_(saved)
        self._saved.clear()
        for module, attributes in self._attributes:
            if not _same_items(list(module.__dict__.items()), list(attributes.items())):
                module.__dict__.clear()
                module.__dict__.update(attributes)
        for container, contents in self._contents:
            _put_back(container, contents)


@contextlib.contextmanager
def user_generators() -> Iterator[None]:
    """Python's and numpy's global random generators as they were, after a replay (or ``__getitem__``) ran."""
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(python)
        if numpy is not None:
            numpy.random.set_state(state)


@contextlib.contextmanager
def uncached_parametrizations() -> Iterator[None]:
    """Parametrized tensors computed afresh inside, the user's ``parametrize.cached()`` cache put back after."""
    cache, enabled = parametrize._cache, parametrize._cache_enabled
    parametrize._cache, parametrize._cache_enabled = {}, 0
    try:
        yield
    finally:
        parametrize._cache, parametrize._cache_enabled = cache, enabled


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[ModelGuard]:
    """Run a replay of ``model``'s forward; give the guard whose ``before_write`` the op tracer must call."""
    guard = ModelGuard(model)
    try:
        with uncached_parametrizations():
            yield guard
    finally:
        guard.restore()


class ArgumentGuard:
    """The Python state of the plain objects among a call's arguments, and of those their containers hold."""

    def __init__(self, args: Iterable[Any], kwargs: Mapping[str, Any]) -> None:
        objects: dict[int, Any] = {}
        for value in _flattened([*args, *kwargs.values()]):
            _add_object(objects, value)
            for attribute in list(vars(value).values()) if id(value) in objects else ():
                if isinstance(attribute, _CONTAINERS):
                    for item in _flattened(_contents(attribute)):
                        _add_object(objects, item)  # a cache's layers, one level down
        self._attributes = [(value, dict(vars(value))) for value in objects.values()]
        self._contents = [(attribute, _contents(attribute)) for _value, attributes in self._attributes
                          for attribute in attributes.values() if isinstance(attribute, _CONTAINERS)]
        #: Whether the replay rebound an attribute or changed a container of one of these objects.
        self.changed = False

    def restore(self) -> None:
        for value, attributes in self._attributes:
            if not _same_items(list(vars(value).items()), list(attributes.items())):
                self.changed = True
                vars(value).clear()
                vars(value).update(attributes)
        for container, contents in self._contents:
            if not _same_items(_contents(container), contents):
                self.changed = True
                _put_back(container, contents)


@contextlib.contextmanager
def arguments_untouched(args: Iterable[Any], kwargs: Mapping[str, Any]) -> Iterator[ArgumentGuard]:
    """Run a replay on ``args`` and ``kwargs``; the plain objects among them are put back as they were after it."""
    guard = ArgumentGuard(args, kwargs)
    try:
        yield guard
    finally:
        guard.restore()


def _flattened(values: Iterable[Any]) -> Iterator[Any]:
    """``values`` with the items of their tuples, lists and dicts (one level), as a call's arguments hold them."""
    for value in values:
        if type(value) in (tuple, list):
            yield from value
        elif type(value) is dict:
            yield from value.values()
        else:
            yield value


def _add_object(objects: dict[int, Any], value: Any) -> None:
    """Note ``value`` if it is a plain object with a ``__dict__`` (not a tensor, module, class or function)."""
    if (isinstance(value, (torch.Tensor, nn.Module, type)) or callable(value)
            or not isinstance(getattr(value, "__dict__", None), dict)):
        return
    objects.setdefault(id(value), value)


def _storage_of(tensor: Any) -> torch.UntypedStorage | None:
    """A plain dense tensor's storage; None for what has none to save (meta, sparse, a lazy device's)."""
    if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.layout is not torch.strided or tensor.is_meta:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (XLA, lazy): nothing to put back
        return None


def _tensors_in(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors among ``values`` and directly inside those that are lists, tuples or dicts."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple, collections.deque)):
            yield from (item for item in value if isinstance(item, torch.Tensor))
        elif isinstance(value, dict):
            yield from (item for item in value.values() if isinstance(item, torch.Tensor))


def _contents(container: Any) -> list[Any]:
    return list(container.items()) if isinstance(container, dict) else list(container)


def _put_back(container: Any, contents: list[Any]) -> None:
    if _same_items(_contents(container), contents):
        return  # unchanged: leave the user's container alone
    container.clear()
    if isinstance(container, (dict, set)):
        container.update(contents)
    else:
        container.extend(contents)


def _same_items(now: list[Any], before: list[Any]) -> bool:
    """By identity, not ``==``: comparing tensors elementwise is neither cheap nor a bool."""
    if len(now) != len(before):
        return False
    for a, b in zip(now, before):
        if isinstance(a, tuple) and isinstance(b, tuple):  # a dict's items are new tuples each time
            if len(a) != len(b) or any(x is not y for x, y in zip(a, b)):
                return False
        elif a is not b:
            return False
    return True
