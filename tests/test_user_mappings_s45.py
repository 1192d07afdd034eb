"""A mapping of the user's class passed to a model or returned by one: read as stored, its own code never run.

The watch reads the tensors of every call's arguments and outputs from its hooks. A mapping's ``__getitem__``,
``__iter__``, ``items()`` and its keys' ``__repr__`` are the user's code: an LRU cache reorders itself as it is read
(and iterating it then raised ``OrderedDict mutated during iteration`` from the watch's hook, stopping a healthy
loop in every mode), a lazy store loads from disk, a counter counts. The watch reads the dict a mapping keeps its
items in (a dict subclass's own storage, ``UserDict.data``, the one dict attribute of a user's class) with
``dict.items``, and writes a key of the user's class by its class name.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import pytest
import torch
from contract.hunt_s44e import LRUCache as HuntLRUCache
from torch import nn

import nan_magic

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}


class LRUCache(HuntLRUCache):
    """hunt_s44e's least-recently-used cache (a read moves its key to the end), made with its items, counting its
    reads."""

    def __init__(self, **items: torch.Tensor) -> None:
        super().__init__()
        self._order.update(items)
        self.reads = 0

    def __getitem__(self, key: str) -> torch.Tensor:
        self.reads += 1
        return super().__getitem__(key)


class CountingDict(dict):  # type: ignore[type-arg]
    """A dict subclass whose own reads are code: the watch must call none of them."""

    calls = 0

    def __getitem__(self, key: Any) -> Any:
        CountingDict.calls += 1
        return super().__getitem__(key)

    def items(self) -> Any:  # type: ignore[override]
        raise AssertionError("the watch ran the user's items()")

    def values(self) -> Any:  # type: ignore[override]
        raise AssertionError("the watch ran the user's values()")


class Key:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        raise AssertionError("the watch ran the user's __repr__")


class NoIter(list):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        raise AssertionError("the watch ran the user's __iter__")


class Adds(nn.Module):
    """``linear(x) + extra["a"]``: the model reads one item of the mapping it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, extra: Any) -> torch.Tensor:
        return self.linear(x) + extra["a"]


class SumsAll(nn.Module):
    """``linear(x)`` plus every value of the dict it is given (a dict's own values(), in the model's code)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, extra: dict[Any, torch.Tensor]) -> torch.Tensor:
        return self.linear(x) + sum(extra.values())


def _line_of(text: str) -> int:
    """The line of this file holding ``text``."""
    with open(__file__) as source:
        return next(number for number, line in enumerate(source, 1) if text in line and "_line_of" not in line)


def _train(model: nn.Module, extra: Any, options: dict[str, Any] | None, steps: int = 3) -> None:
    """Three steps of SGD, under a watch with ``options`` (None: unwatched)."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nan_magic.watch(model, opt, **options) if options is not None else contextlib.nullcontext():
        for _ in range(steps):
            model(torch.randn(2, 4), extra).sum().backward()
            opt.step()
            opt.zero_grad()


def _cache(a: float = 0.0) -> LRUCache:
    return LRUCache(a=torch.full((4,), a), b=torch.ones(4), c=torch.ones(4))


def _report(model: nn.Module, extra: Any, options: dict[str, Any]) -> Any:
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _train(model, extra, options)
    return caught.value.report


@pytest.mark.parametrize("mode", list(MODES))
def test_an_lru_cache_passed_to_every_step_runs_as_it_does_unwatched(mode: str) -> None:
    unwatched, watched = _cache(), _cache()
    _train(Adds(), unwatched, None)
    _train(Adds(), watched, MODES[mode])  # (raised "OrderedDict mutated during iteration" before session 45)
    assert (list(watched._order), watched.reads) == (list(unwatched._order), unwatched.reads) == (["b", "c", "a"], 3)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_nan_in_an_lru_caches_item_is_data_named_by_its_key(mode: str) -> None:
    cache = _cache(float("nan"))
    report = _report(Adds(), cache, MODES[mode])
    assert (report.phase, report.tensor.path) == ("data", "input[1]['a']")
    assert cache.reads <= 1  # the model's own read at most: the watch read none


@pytest.mark.parametrize("mode", list(MODES))
def test_a_dict_subclass_is_read_as_stored_and_its_reads_never_run(mode: str) -> None:
    CountingDict.calls = 0
    _train(Adds(), CountingDict(a=torch.zeros(4), b=torch.ones(4)), MODES[mode])
    assert CountingDict.calls == 3  # the model's own, one a step
    report = _report(Adds(), CountingDict(a=torch.full((4,), float("inf")), b=torch.ones(4)), MODES[mode])
    assert (report.phase, report.tensor.path) == ("data", "input[1]['a']")


@pytest.mark.parametrize("mode", list(MODES))
def test_a_user_dict_argument_is_read_through_its_data(mode: str) -> None:
    """``collections.UserDict`` (Hugging Face's BatchEncoding) keeps its items in ``.data``."""

    class Features(collections.UserDict):  # type: ignore[type-arg]
        pass

    a = torch.randn(4)
    a[2] = float("nan")
    report = _report(Adds(), Features(a=a, mask=torch.ones(2, 4)), MODES[mode])
    assert (report.phase, report.tensor.path) == ("data", "input[1]['a']")


@pytest.mark.parametrize("mode", list(MODES))
def test_a_key_of_the_users_class_is_written_by_its_class_not_its_repr(mode: str) -> None:
    _train(SumsAll(), {"a": torch.zeros(4), Key("scale"): torch.ones(4)}, MODES[mode])
    report = _report(SumsAll(), {"a": torch.zeros(4), Key("scale"): torch.full((4,), float("nan"))}, MODES[mode])
    assert (report.phase, report.tensor.path) == ("data", "input[1][<Key>]")


class Indexed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, extra: Any) -> torch.Tensor:
        return self.linear(x) + list.__getitem__(extra, 0)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_list_subclass_is_read_as_stored(mode: str) -> None:
    _train(Indexed(), NoIter([torch.zeros(4)]), MODES[mode])
    report = _report(Indexed(), NoIter([torch.full((4,), float("nan")), torch.zeros(4)]), MODES[mode])
    assert (report.phase, report.tensor.path) == ("data", "input[1][0]")


class Heads(nn.Module):
    """Returns its two heads in an LRU cache (a module's output is read at every call)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> LRUCache:
        return LRUCache(a=self.body(x), b=self.head(x).exp())


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = Heads()

    def forward(self, x: torch.Tensor, extra: Any) -> torch.Tensor:
        out = self.heads(x)
        return out["a"] + out["b"]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_module_returning_a_users_mapping_is_read_as_stored(mode: str) -> None:
    _train(Cached(), None, MODES[mode])
    model = Cached()
    with torch.no_grad():
        model.heads.head.bias.fill_(1000.0)  # exp(1000): inf in the second head
    report = _report(model, None, MODES[mode])
    assert (report.phase, report.module, report.op) == ("forward", "heads", "aten.exp.default")
    assert report.source is not None and report.source.lineno == _line_of("b=self.head(x).exp()")
