"""hunt_s44e, a batch object holding a mapping whose reads run the user's code: the watch runs none of it.

The batch entering a model is read with its attributes (hot/object_reads.py). A mapping attribute was walked with
its own ``items()``: an LRU cache (whose read moves the key to the end, as cachetools' ``LRUCache``) was reordered
by the watch and its iteration raised ``OrderedDict mutated during iteration`` from our hook; a lazy config mapping
whose ``__getitem__`` raises (omegaconf's ``???``) raised its ``KeyError`` into the step. Both are healthy loops:
silent, bit-identical, the cache's order the model's own.

A static KV cache's additive bias, all -inf but the slots filled so far, which the model opens in place
(``bias[..., n] = 0``) before its attention reads it: as it enters at step 0 it is all -inf, no mask by the mask
rule (ops/masks.py), and was reported as bad input data, held by an object (the cache), given as a plain argument,
and (slot 0 open before) by the deferred check alone, which read it after the write (only its probe left). Healthy,
all three: silent and bit-identical in every mode. Its broken twin, a bias the model never opens (softmax over
nothing but -inf: NaN), is still the batch's event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from contract import Case, Expect, Scenario
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


class StaticCache:
    def __init__(self, first_open: bool) -> None:
        self.k, self.v = torch.zeros(1, 8, 8), torch.zeros(1, 8, 8)
        self.bias, self.n = torch.full((1, 1, 8), float("-inf")), 0
        if first_open:
            self.bias[..., 0] = 0


class CachedDecoder(nn.Module):
    """One decode step over a static KV cache, given as the cache object or as its plain tensors."""

    def __init__(self, opens: bool) -> None:
        super().__init__()
        self.opens = opens
        self.k, self.v, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: StaticCache | None = None, keys: torch.Tensor | None = None,
                values: torch.Tensor | None = None, bias: torch.Tensor | None = None, n: int = 0) -> torch.Tensor:
        if cache is not None:
            keys, values, bias, n = cache.k, cache.v, cache.bias, cache.n
            cache.n += 1
        assert keys is not None and values is not None and bias is not None
        keys[:, n] = self.k(x)[:, 0]
        values[:, n] = self.v(x)[:, 0]
        if self.opens:
            bias[..., n] = 0  # the slot filled is attended from now on
        scores = x @ keys.transpose(1, 2) + bias  # producer: static cache attention
        return self.o(scores.softmax(-1) @ values)


def _decode(as_object: bool, first_open: bool, opens: bool = True) -> Scenario:
    torch.manual_seed(0)
    model = CachedDecoder(opens).eval()

    def run() -> list[torch.Tensor]:
        outputs = []
        with torch.no_grad():
            cache, x = StaticCache(first_open), torch.randn(1, 1, 8)
            for step in range(6):
                x = model(x, cache) if as_object else model(x, None, cache.k, cache.v, cache.bias, step)
                outputs.append(x.clone())
        return outputs

    return Scenario((model,), run)


CASES = [
    Case("hunt_s44_static_cache_object_opened_in_place_healthy", lambda: _decode(True, False), None),
    Case("hunt_s44_static_cache_plain_bias_opened_in_place_healthy", lambda: _decode(False, False), None),
    Case("hunt_s44_static_cache_plain_bias_first_slot_open_healthy", lambda: _decode(False, True), None),
    Case("hunt_s44_static_cache_object_first_slot_open_healthy", lambda: _decode(True, True), None),
    Case("hunt_s44_static_cache_bias_never_opened_is_data", lambda: _decode(False, False, opens=False),
         Expect("data", "", "CachedDecoder", step=0, op=None, kinds=frozenset({"-inf"}), cause="bad-input-data")),
    Case("hunt_s44_batch_object_holding_an_lru_cache_healthy", _lru, None),
    Case("hunt_s44_batch_object_holding_a_mapping_that_raises_healthy", lambda: _held(LazyConfig()), None),
]
