"""The values inside a ``torch.func`` transform's wrapper, for a read (hot/reads.py) where a wrapper met it.

A training step made wholly of transforms (``grad(loss_fn)(params, x, y)`` over ``functional_call``, DP-SGD's
``vmap(grad(...))``) runs every forward on wrappers: grad's ``TensorWrapper``, vmap's ``BatchedTensor``. The watch
reads the plain tensor each one wraps: no ``.item()`` on a batched value (which vmap forbids), nothing asked of the
wrapper or its graph, so the transform computes what it computes unwatched. Off the hot path: a plain tensor never
reaches here (reads.py asks only where its read of a tensor gave up).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["unwrapped", "wraps_a_parameter"]

_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_unwrap = torch._C._functorch.get_unwrapped
_PLAIN = (torch.Tensor, nn.Parameter)


def unwrapped(tensor: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding a transform's wrapper's values (grad's, jvp's, vmap's), detached; None for another
    tensor, or where those values are no plain tensor's (functionalize's, or an efficient zero: jvp's zero tangent).

    vmap's batched tensor unwraps to its whole batch (the batch dimension included), a nest of transforms
    (``vmap(grad(f))``) to the innermost tensor.
    """
    if not _wrapped(tensor):
        return None
    while _wrapped(tensor):
        if torch._is_functional_tensor(tensor):
            return None  # functionalize's: its inner tensor may not hold the pending writes yet (no sync here)
        tensor = _unwrap(tensor)
    if type(tensor) not in _PLAIN or tensor._is_zerotensor():
        return None
    if not tensor.requires_grad:
        return tensor
    with torch._C._DisableFuncTorch():  # (a detach under the transform would return the transform's wrapper again)
        return tensor.detach()


def wraps_a_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a transform's wrapper of an ``nn.Parameter``: the model's own weight, passed to the
    transform as ``dict(model.named_parameters())`` (no stand-in of the loop's, though no ``nn.Parameter`` itself)."""
    while _wrapped(tensor) and not torch._is_functional_tensor(tensor):
        tensor = _unwrap(tensor)
    return isinstance(tensor, nn.Parameter)
