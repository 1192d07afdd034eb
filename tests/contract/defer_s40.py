"""Deferred vs immediate on GPU-style loops: static input buffers, a batch written in place between calls (defer-s40).

Every row runs in the immediate default and in ``defer=True`` (what a CUDA user gets). A static input buffer (the
CUDA-graph / prefetcher idiom: ``buf.copy_(batch)`` for each micro-batch) refilled for 4 micro-batches per optimizer
step, with a ``log`` of a zero in the forward or a ``sqrt`` of a zero distance in a loss helper's backward: the
deferred watch names what the immediate one names. A batch written in place *after* the model read it and before the
step's check (a second view built in place by ``x.add_``/``x.mul_``, or the next batch prefetched into the same buffer
before ``backward()``) left the deferred check's replay only the written values: defer=True named the model, phase
and step but no op nor line ('unclassified'; the prefetched one even named ``body.0``), where the immediate watch
named ``aten.log.default`` at its line. Now the loss code's first in-place write of a kept call's input keeps a copy
of it first (StepKeeping.input_written), and the replay starts from the value the call read.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario

STEPS = 4


class LogFeatures(nn.Module):
    """A classifier over the log of positive features with a skip of their mean log (a zero feature makes its row of
    the output -inf, certain on any kernel)."""

    def __init__(self, spelled: str = "torch") -> None:
        super().__init__()
        self.spelled = spelled
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spelled == "method":  # noqa: SIM108 (each spelling on its own line, marked)
            h = x.log()  # producer: log method
        else:
            h = torch.log(x)  # producer: log call
        return self.head(self.body(h)) + 0.1 * h.mean(1, keepdim=True)


def _positive(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(n, 6, generator=g) + 0.5 for _ in range(STEPS)]


def _labels(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 3, (n,), generator=g) for _ in range(STEPS)]


# ---------------------------------------------------------------- a static buffer over 4 micro-batches, forward
def _static_accumulation(at: tuple[int, int] | None, spelled: str = "torch", dtype: torch.dtype | None = None
                         ) -> Scenario:
    """AdamW over 4 micro-batches per step, each copied into one static input buffer; micro-batch ``at[1]`` of step
    ``at[0]`` holds a feature of exactly 0 (log is -inf). ``dtype``: the forward under CPU autocast of that dtype."""
    torch.manual_seed(0)
    model = LogFeatures(spelled)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs = [_positive(2, seed) for seed in range(STEPS)]
    ys = [_labels(2, 10 + seed) for seed in range(STEPS)]
    if at is not None:
        xs[at[0]][at[1]][1, 3] = 0.0
    buf, ybuf = torch.empty(2, 6), torch.empty(2, dtype=torch.long)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            for micro in range(4):
                buf.copy_(xs[step][micro])
                ybuf.copy_(ys[step][micro])
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    out = model(buf)
                loss = F.cross_entropy(out.float(), ybuf) / 4
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a static buffer, backward in a loss helper
def distance_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(((out - target) ** 2).sum(1)).mean()  # producer: distance


def _static_distance(step_at: int | None) -> Scenario:
    """SGD over 4 micro-batches through static buffers; the target is the model's own no-grad output plus 0.5, but at
    micro-batch 0 of step ``step_at`` exactly the output: a distance of 0, whose sqrt's backward is ``0 / 0``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [_positive(2, seed) for seed in range(STEPS)]
    xbuf, tbuf = torch.empty(2, 6), torch.empty(2, 3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            for micro in range(4):
                xbuf.copy_(xs[step][micro])
                with torch.no_grad():
                    target = model(xbuf)
                tbuf.copy_(target if (step, micro) == (step_at, 0) else target + 0.5)
                loss = distance_loss(model(xbuf), tbuf) / 4
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- the batch written in place after the model read it
def _written_after_the_call(step_at: int | None, how: str, spelled: str = "torch",
                            dtype: torch.dtype | None = None) -> Scenario:
    """Two views per step through one model, the second built in place on the batch after the first forward
    (``how="add"``: ``x.add_(0.25)``; ``"mul"``: ``x.mul_(1.5).add_(0.25)``; ``"index"``:
    ``x[:, :3] = 1.0``; ``"prefetch"``: the next step's batch
    copied into the static buffer before the backward, as a prefetcher does). Step ``step_at``'s batch holds a
    feature of exactly 0: the first view's log is -inf. ``dtype``: the forwards under CPU autocast of that dtype."""
    torch.manual_seed(0)
    model = LogFeatures(spelled)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _positive(8, 3), _labels(8, 4)
    if step_at is not None:
        xs[step_at][4, 1] = 0.0
    buf = torch.empty(8, 6)

    def run() -> list[torch.Tensor]:
        losses = []
        buf.copy_(xs[0])
        for step in range(STEPS):
            if how == "prefetch":
                loss = F.cross_entropy(model(buf), ys[step])
                buf.copy_(xs[(step + 1) % STEPS])
            else:
                x = xs[step].clone()
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    first = model(x).float()
                if how == "add":
                    x.add_(0.25)
                elif how == "index":
                    x[:, :3] = 1.0  # (a feature-dropout view, written through an index)
                else:
                    x.mul_(1.5).add_(0.25)
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    second = model(x).float()
                loss = F.cross_entropy(first, ys[step]) + F.mse_loss(second, first.detach())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _log(step: int, marker: str = "log call") -> Expect:
    return Expect("forward", "", "LogFeatures", step=step, op="aten.log.default", marker=marker, cause="log-domain")


CASES = [
    Case("defer_s40_static_buffer_accumulation_log_of_a_zero_feature_step_1", lambda: _static_accumulation((1, 1)),
         _log(1)),
    Case("defer_s40_static_buffer_accumulation_log_of_a_zero_feature_step_0", lambda: _static_accumulation((0, 0)),
         _log(0)),
    Case("defer_s40_static_buffer_accumulation_log_method_last_micro_batch", lambda: _static_accumulation(
        (2, 3), "method"), _log(2, "log method")),
    Case("defer_s40_static_buffer_accumulation_bf16_autocast_log_of_a_zero", lambda: _static_accumulation(
        (1, 2), dtype=torch.bfloat16), _log(1)),
    Case("defer_s40_static_buffer_accumulation_healthy", lambda: _static_accumulation(None), None),
    Case("defer_s40_static_buffer_accumulation_bf16_autocast_healthy", lambda: _static_accumulation(
        None, dtype=torch.bfloat16), None),
    Case("defer_s40_static_buffers_sqrt_of_a_zero_distance_step_2", lambda: _static_distance(2),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="distance", cause="sqrt-domain")),
    Case("defer_s40_static_buffers_sqrt_of_a_zero_distance_step_0", lambda: _static_distance(0),
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="distance", cause="sqrt-domain")),
    Case("defer_s40_static_buffers_distance_healthy", lambda: _static_distance(None), None),
    Case("defer_s40_second_view_built_in_place_log_of_a_zero_step_2", lambda: _written_after_the_call(2, "add"),
         _log(2)),
    Case("defer_s40_second_view_built_in_place_log_method_step_0", lambda: _written_after_the_call(
        0, "mul", "method"), _log(0, "log method")),
    Case("defer_s40_second_view_built_in_place_bf16_autocast_log_of_a_zero_step_1", lambda: _written_after_the_call(
        1, "add", dtype=torch.bfloat16), _log(1)),
    Case("defer_s40_second_view_written_through_an_index_log_of_a_zero_step_2", lambda: _written_after_the_call(
        2, "index"), _log(2)),
    Case("defer_s40_second_view_written_through_an_index_healthy", lambda: _written_after_the_call(None, "index"),
         None),
    Case("defer_s40_second_view_built_in_place_healthy", lambda: _written_after_the_call(None, "add"), None),
    Case("defer_s40_second_view_built_in_place_bf16_autocast_healthy", lambda: _written_after_the_call(
        None, "mul", dtype=torch.bfloat16), None),
    Case("defer_s40_next_batch_prefetched_into_the_buffer_log_of_a_zero_step_1", lambda: _written_after_the_call(
        1, "prefetch"), _log(1)),
    Case("defer_s40_next_batch_prefetched_into_the_buffer_healthy", lambda: _written_after_the_call(None, "prefetch"),
         None),
]
