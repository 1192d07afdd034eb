"""lead25: a loss helper whose other values are non-finite on every step, then a real NaN in the loss.

The watch names the code outside the models by running its recorded ops again under the op tracer. It named the
first op of the helper that made any non-finite value, whether or not that value reached the loss: a perplexity or
a ratio the helper computes only to log (inf on every step, read by ``.item()``), an overflow a ``tanh`` absorbs,
were named in place of the ``log`` whose NaN the loss carried (ops=True named the log). Each with its twin, where
only the logged values are non-finite: calm and bit-identical in every mode. And a backward producer in a loss
module the loop calls but does not watch (an RMSE whose root's gradient at a distance of 0 is infinite).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import loader_loop as _loader_loop
from contract.loops import sgd_loop as _loop

LOGGED: list[float] = []  # what the helpers "log": read on the host, as a logger would


def _model() -> nn.Module:
    """Seeds the generator first: the batches drawn after it are the same in each build."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


# ---------------------------------------------------------------- a logged ratio that is inf on every step
def _logged_ratio(real: bool) -> Scenario:
    """A helper that logs ``sum / count`` over an empty selection (inf: the count is 0) under no_grad on every step;
    at step 2 its likelihood's probability is scaled to 0 (``real``) and the log of it is -inf."""
    model = _model()
    xs, ys = _batches(6, 4), [torch.randint(0, 3, (6,)) for _ in range(4)]

    def loss_of(out: torch.Tensor, step: int) -> torch.Tensor:
        with torch.no_grad():
            count = (ys[step] > 5).sum()  # never: the ratio is inf on every step
            LOGGED.append((out.abs().sum() / count).item())
        p = out.softmax(-1).gather(1, ys[step][:, None]) * (0.0 if real and step == 2 else 1.0)
        return -p.log().mean()  # producer: logged ratio

    return _loop(model, lambda step: (xs[step],), loss_of)


# ---------------------------------------------------------------- a perplexity that overflows, with grad on
def _logged_perplexity(real: bool) -> Scenario:
    """``exp`` of a huge per-token loss (inf), computed with autograd on but only read by ``.item()``; at step 2 the
    loss's own division by the number of valid tokens divides by 0 (``real``)."""
    model = _model()
    xs, ys = _batches(6, 4), [torch.randint(0, 3, (6,)) for _ in range(4)]

    def loss_of(out: torch.Tensor, step: int) -> torch.Tensor:
        total = F.cross_entropy(out, ys[step], reduction="sum")
        LOGGED.append((total * 1e4).exp().item())  # inf: a perplexity nobody backpropagates through
        n_valid = torch.tensor(0.0 if real and step == 2 else 6.0)
        return total / n_valid  # producer: logged perplexity

    return _loop(model, lambda step: (xs[step],), loss_of)


# ---------------------------------------------------------------- an overflow a tanh absorbs
def _absorbed_overflow(real: bool) -> Scenario:
    """Confidence weights ``tanh(exp(100 * out))`` of the detached output: the exp overflows, the tanh makes it 1,
    every step. At step 2 the weighted loss takes the log of an output scaled to 0 (``real``)."""
    model = _model()
    xs = _batches(6, 4)

    def loss_of(out: torch.Tensor, step: int) -> torch.Tensor:
        weight = torch.tanh(torch.exp(out.detach() * 100.0))
        scale = 0.0 if real and step == 2 else 1.0
        return -(weight * (out.sigmoid() * scale).log()).mean()  # producer: absorbed overflow

    return _loop(model, lambda step: (xs[step],), loss_of)


# ---------------------------------------------------------------- a loss module the loop does not watch
class RMSE(nn.Module):
    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        mse = ((out - target) ** 2).mean()
        return mse.sqrt()  # producer: unwatched rmse


def _unwatched_rmse(real: bool) -> Scenario:
    """``RMSE()(out, y)``, a criterion module outside ``watch(model, opt)``; at step 2 the targets are the outputs
    (``real``: a distance of 0, whose root's gradient is infinite). The twin adds an eps under the root."""
    model = _model()
    xs, ys = _batches(6, 4), _batches(6, 3)
    criterion = RMSE()

    def loss_of(out: torch.Tensor, step: int) -> torch.Tensor:
        target = out.detach() if step == 2 else ys[step]
        return criterion(out, target) if real else (((out - target) ** 2).mean() + 1e-8).sqrt()

    return _loop(model, lambda step: (xs[step],), loss_of)


# ---------------------------------------------------------------- the same inside a module's forward
class Gated(nn.Module):
    """A gate ``tanh(exp(100 h))`` of the detached features (the exp overflows, the tanh makes it 1) and a ratio it
    logs (inf: an empty count), on every step; then the log of the gated features, scaled to 0 at the failing step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.scale = nn.Linear(4, 8), 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        gate = torch.tanh(torch.exp(h.detach() * 100.0))
        with torch.no_grad():
            LOGGED.append((h.abs().sum() / (h > 1e9).sum()).item())
        return ((h * gate).abs() + 1).mul(self.scale).log()  # producer: gated log


def _gated(real: bool) -> Scenario:
    """mode="full" replays the module whose output went non-finite: it named the exp its own tanh absorbed."""
    torch.manual_seed(0)
    model = nn.Sequential(Gated(), nn.Linear(8, 3))
    xs, ys = _batches(6, 4), [torch.randint(0, 3, (6,)) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        model[0].scale = 0.0 if real and step == 2 else 1.0
        return (xs[step],)

    return _loop(model, batch, lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- the same in a Dataset's __getitem__
class Saturated(torch.utils.data.Dataset):
    """Features ``tanh(exp(100 d))`` (the exp overflows, the tanh makes it 1, in every sample) beside the log of a
    per-sample scale, 0 in sample 9 (``real``)."""

    def __init__(self, real: bool) -> None:
        g = torch.Generator().manual_seed(1)
        self.d = [torch.rand(4, generator=g) * 10 for _ in range(16)]
        self.scale = [torch.rand(1, generator=g) + 0.5 for _ in range(16)]
        if real:
            self.scale[9][0] = 0.0

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        saturated = torch.tanh(torch.exp(self.d[i] * 100.0))
        return torch.cat([saturated, self.scale[i].log()]), torch.tensor(i % 3)  # producer: saturated sample


def _saturated(real: bool, workers: int) -> Scenario:
    """In the main process the data code's records name the op; from workers, fetching the samples again does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    loader = torch.utils.data.DataLoader(Saturated(real), batch_size=4, num_workers=workers)
    return _loader_loop(model, loader, F.cross_entropy)


CASES = [
    Case("lead25_dataset_saturating_an_overflow_then_log_of_0", lambda: _saturated(True, 0),
         Expect("data", "", step=2, op="aten.log.default", marker="saturated sample", cause="log-domain")),
    Case("lead25_dataset_saturating_an_overflow_healthy", lambda: _saturated(False, 0), None),
    Case("lead25_dataset_in_workers_saturating_an_overflow_then_log_of_0", lambda: _saturated(True, 2),
         Expect("data", "", step=2, op="aten.log.default", marker="saturated sample", cause="log-domain")),
    Case("lead25_dataset_in_workers_saturating_an_overflow_healthy", lambda: _saturated(False, 2), None),
    Case("lead25_module_gate_absorbing_an_overflow_then_log_of_0", lambda: _gated(True),
         Expect("forward", "0", "Gated", step=2, op="aten.log.default", marker="gated log", cause="log-domain")),
    Case("lead25_module_gate_absorbing_an_overflow_healthy", lambda: _gated(False), None),
    Case("lead25_loss_helper_logging_an_inf_ratio_then_log_of_0", lambda: _logged_ratio(True),
         Expect("forward", None, step=2, op="aten.log.default", marker="logged ratio", cause="log-domain")),
    Case("lead25_loss_helper_logging_an_inf_ratio_healthy", lambda: _logged_ratio(False), None),
    Case("lead25_loss_logging_an_overflowed_perplexity_then_division_by_0", lambda: _logged_perplexity(True),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="logged perplexity",
                cause="division-by-zero")),
    Case("lead25_loss_logging_an_overflowed_perplexity_healthy", lambda: _logged_perplexity(False), None),
    Case("lead25_overflow_absorbed_by_tanh_then_log_of_0", lambda: _absorbed_overflow(True),
         Expect("forward", None, step=2, op="aten.log.default", marker="absorbed overflow", cause="log-domain")),
    Case("lead25_overflow_absorbed_by_tanh_healthy", lambda: _absorbed_overflow(False), None),
    Case("lead25_unwatched_rmse_module_at_a_distance_of_0", lambda: _unwatched_rmse(True),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="unwatched rmse", cause="sqrt-domain")),
    Case("lead25_rmse_with_eps_healthy", lambda: _unwatched_rmse(False), None),
]
