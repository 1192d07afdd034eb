"""A loss helper in its own file, as a project's ``losses.py``: a deferred row's line must be this file's (defer_s33).

Not a contract module of its own (no ``CASES``): tests/contract/defer_s33.py calls it.
"""

from __future__ import annotations

import torch


def masked_mean_error(prediction: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """The squared error averaged over the samples ``mask`` keeps: ``0 / 0`` for a batch it keeps none of."""
    err = ((prediction - target) ** 2).mean(-1)
    return (err * mask).sum() / (mask.sum() + eps)  # producer: helper loss
