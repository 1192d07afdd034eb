"""Which models' forwards write their own input in place, learned from their calls, for a replay of the step.

A step replay runs a top-level call again from the arguments the call received (localize/replay/tiered/root_calls.py). A
forward that writes its input in place (``x /= x.norm(dim=1, keepdim=True)``, a normalisation the user meant to be
cheap) leaves the caller's batch as the write made it: a replay from there meets the NaN the write put in, and
cannot name the op that made it. Copying every batch at every call would cost every user a copy per step; so, as
for the parameters a forward writes (parameter_writes.py), only a model seen writing its input pays it. The
per-module watch's replay of such a call starts from the same copy, where it keeps the step's calls for its fix
trials (localize/replay/producer_call.py).

Seen: a top-level call whose input's version counter moved between its start and its return (the versions are
read at the call's start anyway, for the replay's own check; replay/tiered/step_keeping.py reads each once more as
the call returns, in a loop with no Python call).
Learned from any call, not only the first: a forward that writes its input only on some calls is copied from the
call after the first such write. Not learned: a write through ``.data`` (no version counter moves), or a first
write at the failing call itself (nothing was kept before it: the replay says its input was modified in place).
"""

from __future__ import annotations

import torch

__all__ = ["inputs_before"]


def inputs_before(versions: list[tuple[torch.Tensor, int]]) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """``(input, a copy of its value now)`` for each input tensor of a call about to start (a learned writer's)."""
    return tuple((tensor, tensor.detach().clone()) for tensor, _version in versions)
