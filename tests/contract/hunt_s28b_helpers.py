"""hunt_s28b's loss helpers, kept in a module of their own as users keep them (``losses.py``): a producer that lives
in code the training loop imports, not in the loop's cell nor in a module's ``forward``."""

from __future__ import annotations

import math

import torch


def iwae_bound(log_weights: torch.Tensor, stable: bool) -> torch.Tensor:
    """The importance-weighted bound ``log mean_k w_k`` per sample; the slip exponentiates the log-weights, the
    reference takes ``logsumexp - log K``."""
    if stable:
        return torch.logsumexp(log_weights, 0) - math.log(log_weights.shape[0])
    return torch.log(torch.exp(log_weights).mean(0))  # producer: iwae log mean exp
