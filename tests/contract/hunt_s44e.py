"""hunt_s44e, a batch object holding a mapping whose reads run the user's code: the watch runs none of it.

The batch entering a model is read with its attributes (hot/object_reads.py). A mapping attribute was walked with
its own ``items()``: an LRU cache (whose read moves the key to the end, as cachetools' ``LRUCache``) was reordered
by the watch and its iteration raised ``OrderedDict mutated during iteration`` from our hook; a lazy config mapping
whose ``__getitem__`` raises (omegaconf's ``???``) raised its ``KeyError`` into the step. Both are healthy loops:
silent, bit-identical, the cache's order the model's own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from contract import Case, Scenario
from contract.loops import batches as _batches


class LRUCache(MutableMapping):  # type: ignore[type-arg]
    """As cachetools' ``LRUCache``: a read moves the key to the end (the least recently used first)."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __getitem__(self, key: str) -> torch.Tensor:
        self._order.move_to_end(key)
        return self._order[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self._order[key] = value

    def __delitem__(self, key: str) -> None:
        del self._order[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class LazyConfig(Mapping):  # type: ignore[type-arg]
    """A config whose unset entry raises when read (omegaconf's ``???``)."""

    def __init__(self) -> None:
        self._keys = ["scale", "missing"]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == "missing":
            raise KeyError("missing mandatory value: missing")
        return torch.ones(4)


class Features:
    def __init__(self, x: torch.Tensor, held: Mapping[str, Any]) -> None:
        self.x, self.held = x, held


class PriorNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, batch: Features) -> torch.Tensor:
        prior = batch.held["prior"] if isinstance(batch.held, LRUCache) else batch.held["scale"]
        return self.fc(batch.x + prior).pow(2).mean()


def _held(held: Mapping[str, Any]) -> Scenario:
    torch.manual_seed(0)
    model = PriorNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = _batches(4, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = model(Features(xs[step], held))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        if isinstance(held, LRUCache) and list(held) != ["other", "prior"]:  # (the model's reads: prior last)
            raise AssertionError(f"the cache's order is not the model's: {list(held)}")
        return losses

    return Scenario((model, opt), run)


def _lru() -> Scenario:
    cache = LRUCache()
    cache["prior"], cache["other"] = torch.zeros(4), torch.ones(4)
    return _held(cache)


CASES = [
    Case("hunt_s44_batch_object_holding_an_lru_cache_healthy", _lru, None),
    Case("hunt_s44_batch_object_holding_a_mapping_that_raises_healthy", lambda: _held(LazyConfig()), None),
]
