"""Whether a trial's gradients are 0 for any loss, where its backward started from ones (no loss code was kept).

A gradient of ones into the outputs stands for the loss (step.py), and a remedy after which no trained parameter
gets any gradient is said to hide the NaN (trial_facts.py's ``no_gradient``). But ones lie in the null space of
every output that is centred or normalised: a z-score ``(p - p.mean()) / (p.std() + eps)``, a softmax, so their
zero gradient says nothing of the user's loss. A second backward from a fixed random direction (its own generator:
the user's random state is not drawn from) tells a Jacobian that is 0 from one that only maps ones to 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

__all__ = ["gradient_sums", "probed_gradients"]


def probed_gradients(outputs: Sequence[torch.Tensor], parameters: Sequence[torch.Tensor], scale: float = 1.0
                     ) -> tuple[torch.Tensor | None, ...]:
    """The parameters' gradients from a seeded random output gradient times ``scale`` (the graph kept by the
    backward before, kept again for another probe)."""
    directions = []
    for output in outputs:
        generator = torch.Generator(output.device).manual_seed(0)
        direction = torch.randn(output.shape, generator=generator, device=output.device) * scale
        directions.append(direction.to(output.dtype))
    return tuple(torch.autograd.grad(list(outputs), list(parameters), grad_outputs=directions, allow_unused=True,
                                     retain_graph=True))


def gradient_sums(grads: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor],
                  parameters: Sequence[torch.Tensor], ones: bool) -> tuple[float | None, ...]:
    """Each parameter's gradient, its absolute values summed (step.py's ``StepOutcome.gradients``); where the
    backward started from ``ones`` and every one is 0, those of :func:`probed_gradients` instead."""
    if ones and not any(grad is not None and bool(grad.any()) for grad in grads):
        with contextlib.suppress(RuntimeError):  # (a graph that cannot run backward twice: the ones' gradients stand)
            # A direction whose backward overflows (float16) is tried again scaled down (gradients are linear in it);
            # one that still does not come out finite says nothing: the ones' gradients stand.
            for scale in (1.0, 2.0**-14):
                probed = probed_gradients(outputs, parameters, scale)
                if all(grad is None or bool(grad.isfinite().all()) for grad in probed):
                    grads = probed
                    break
    return tuple(None if grad is None else float(grad.double().abs().sum()) for grad in grads)
