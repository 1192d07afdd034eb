"""What the watch reads of an object of the user's class: its own tensors, read without running any of its code.

A batch object (a graph library's ``Data``) or a result object (detectron2's ``Instances``, a user's class) keeps
its tensors as attributes, in a plain dict attribute (``Instances._fields``), or in a storage object of a known
layout (PyG's ``_store``, whose own ``_mapping`` is a plain dict). These reads run inside the watch's hooks, on
every top-level call and on the module outputs read, so they are bounded and run nothing of the user's:

- only the object's own ``__dict__`` (``object.__getattribute__``: no ``__getattr__``, no property), a plain
  ``dict`` (``type(d) is dict``: a user ``Mapping``'s ``__getitem__`` may reorder an LRU cache or raise), and a
  tensor, or an object holding tensors of its own (a ``Boxes``), at the top of an attribute or of a dict's value;
- no list or tuple under an attribute (a cache's layers, a stats log that grows every step), no mapping of over
  :data:`MAX_ENTRIES` entries (a vocabulary), at most :data:`MAX_TENSORS` tensors for one read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: A dict attribute of more entries is no object's fields (a vocabulary, an embedding table by word): not read.
MAX_ENTRIES = 64
#: The most tensors one read of a value's objects takes: a batch object's fields are a few (PyG's ``Data``: x,
#: edge_index, edge_attr, y, pos, batch, masks); a state passed in every call (an EMA shadow of every parameter) is
#: no batch, and each tensor read costs about 20 Python calls a step: its first ones only.
MAX_TENSORS = 16

_LEAVES = (str, bytes, int, float, bool, type(None))
_NOT_PLAIN = (nn.Module, type, torch.optim.Optimizer, *_LEAVES)


def object_tensors(value: Any, limit: int = MAX_TENSORS) -> list[tuple[str, torch.Tensor]] | None:
    """``(path, tensor)`` for at most ``limit`` tensors a plain object holds (see the module docstring): ``.x``,
    ``._fields['scores']``, ``._fields['pred_boxes'].tensor``, ``._store['x']`` (PyG's storage, read as the
    mapping it is). None for no plain object: a module, a class, an optimizer, an object without a ``__dict__``
    (``__slots__``)."""
    fields = own_fields(value)
    if fields is None:
        return None
    found: list[tuple[str, torch.Tensor]] = []
    for name, item in list(fields.items()):
        if len(found) >= limit:
            break
        if not isinstance(name, str):
            continue
        if isinstance(item, torch.Tensor):
            found.append((f".{name}", item))
        elif (mapping := _plain_mapping(item)) is not None:
            for key, entry in list(mapping.items()):
                if type(key) is not str and type(key) is not int:
                    continue  # (a key's repr could run the user's code)
                if isinstance(entry, torch.Tensor):
                    found.append((f".{name}[{key!r}]", entry))
                elif (inner := own_fields(entry)) is not None:
                    found += _own_tensors(inner, f".{name}[{key!r}]")
        elif (inner := own_fields(item)) is not None:
            found += _own_tensors(inner, f".{name}")
    return found[:limit]


def own_fields(value: Any) -> dict[str, Any] | None:
    """A plain object's own ``__dict__``, read without its code; None for anything else."""
    if isinstance(value, (_NOT_PLAIN, torch.Tensor, dict, list, tuple)):
        return None
    try:
        fields = object.__getattribute__(value, "__dict__")
    except Exception:  # (a class's own ``__dict__`` descriptor is the user's code: read as nothing)
        return None
    return fields if type(fields) is dict else None


#: The attribute a mapping class of a known layout keeps its items in, as a dict: ``collections.UserDict``'s
#: (Hugging Face's ``BatchEncoding``), tensordict's ``TensorDict``, PyG's ``BaseStorage``.
_STORES = ("data", "_tensordict", "_mapping")


def stored_items(mapping: Any) -> dict[Any, Any] | None:
    """The dict a mapping keeps its items in, read without running its code: a dict (or a dict subclass) itself, the
    dict attribute of a known layout (:data:`_STORES`), or the one dict attribute a mapping class of the user's has
    (an LRU cache over an ``OrderedDict``); None for any other mapping. A mapping's ``__getitem__`` and ``__iter__``
    are its own code, which a hook never runs: an LRU cache reorders itself as it is read, and its iteration then
    raises; a lazy store loads from disk. Read the dict with ``dict.items(...)``: a dict subclass's own ``items()``
    is its code too."""
    if isinstance(mapping, dict):
        return mapping
    fields = own_fields(mapping)
    if fields is None:
        return None
    for name in _STORES:
        if isinstance(store := fields.get(name), dict):
            return store
    stores = [value for value in list(fields.values()) if isinstance(value, dict)]
    return stores[0] if len(stores) == 1 else None


def key_text(key: Any) -> str:
    """A mapping key as a path writes it, ``'logits'`` or ``3``: the repr of a builtin key; another's class name in
    angle brackets (its own ``__repr__`` is code a hook does not run)."""
    if type(key) in _KEYS or (type(key) is tuple and all(type(part) in _KEYS for part in key)):
        return repr(key)
    return f"<{type(key).__name__}>"


_KEYS = (str, int, float, bool, bytes, type(None))


def _plain_mapping(item: Any) -> dict[Any, Any] | None:
    """A plain dict of at most :data:`MAX_ENTRIES` entries: the item itself, or a storage object's own
    ``_mapping`` (PyG's ``BaseStorage``, a ``MutableMapping`` whose methods are not run)."""
    if type(item) is not dict:
        inner = own_fields(item) if not isinstance(item, torch.Tensor) else None
        item = inner.get("_mapping") if inner is not None else None
        if type(item) is not dict:
            return None
    return item if len(item) <= MAX_ENTRIES else None


def _own_tensors(fields: dict[str, Any], path: str) -> list[tuple[str, torch.Tensor]]:
    """An inner object's own tensor attributes (a ``Boxes``'s ``.tensor``), one level: nothing under them."""
    return [(f"{path}.{name}", item) for name, item in list(fields.items())
            if isinstance(name, str) and isinstance(item, torch.Tensor)]
