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

__all__ = ["is_wrapped", "unwrapped", "wraps_a_parameter"]

#: Whether a tensor is a transform's wrapper (grad's, jvp's, vmap's, functionalize's): torch's own test, one C call.
is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_unwrap = torch._C._functorch.get_unwrapped
_PLAIN = (torch.Tensor, nn.Parameter)


def _innermost(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor a nest of wrappers holds, as it is (not detached); None inside functionalize's wrapper, whose inner
    tensor may not hold the pending writes yet (no sync here)."""
    while is_wrapped(tensor):
        if torch._is_functional_tensor(tensor):
            return None
        tensor = _unwrap(tensor)
    return tensor


def unwrapped(tensor: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding a transform's wrapper's values (grad's, jvp's, vmap's), detached; None for another
    tensor, or where those values are no plain tensor's (functionalize's, or an efficient zero: jvp's zero tangent).

    vmap's batched tensor unwraps to its whole batch (the batch dimension included), a nest of transforms
    (``vmap(grad(f))``) to the innermost tensor.
    """
    if not is_wrapped(tensor) or (inner := _innermost(tensor)) is None:
        return None
    if type(inner) not in _PLAIN or inner._is_zerotensor():
        return None
    if not inner.requires_grad:
        return inner
    with torch._C._DisableFuncTorch():  # (a detach under the transform would return the transform's wrapper again)
        return inner.detach()


def wraps_a_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a transform's wrapper of an ``nn.Parameter``: the model's own weight, passed to the
    transform as ``dict(model.named_parameters())`` (no stand-in of the loop's, though no ``nn.Parameter`` itself)."""
    return is_wrapped(tensor) and isinstance(_innermost(tensor), nn.Parameter)
