"""hunt_s27b, when a value is made in a loop that earlier hunts did not try (where: hunt_s27), each with its twin.

At step 0, in a hand-written LAMB's second param group (the trust ratio of a zero update); in a validation pass in
the middle of training (``eval()`` + ``no_grad``, a temperature buffer not calibrated yet, used only in eval; then
``train()`` again before the deferred check); at the first batch holding a token a tokenizer resize added (zero rows
normalised by hand); in a LightningModule-like ``training_step`` (loss code in a method of the watched root, not
its forward); after a best state reloaded with ``load_state_dict`` in the middle of the run, holding a NaN (no
watched code made it); inside the user's own wrapper (``model.module``). Each twin applies its users' fix and must
stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- a hand-written LAMB's trust ratio of a zero update
class Lamb(torch.optim.Optimizer):
    """LAMB as papers print it: Adam's update ``u`` scaled by the trust ratio ``|w| / |u|`` (guarded: 1 where
    either norm is 0, as the reference implementations do)."""

    def __init__(self, params, lr: float = 1e-2, guarded: bool = False) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": 0.0, "guarded": guarded})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"], state["v"], state["t"] = torch.zeros_like(p), torch.zeros_like(p), 0
                state["t"] += 1
                state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                state["v"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                m_hat, v_hat = state["m"] / (1 - 0.9 ** state["t"]), state["v"] / (1 - 0.999 ** state["t"])
                update = m_hat / (v_hat.sqrt() + 1e-6) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = w_norm / u_norm  # producer: trust ratio
                if group["guarded"]:
                    trust = torch.where((w_norm > 0) & (u_norm > 0), trust, torch.ones_like(trust))
                p.add_(update * trust, alpha=-group["lr"])


class TwoTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head_a, self.head_b = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.head_a(h), self.head_b(h)


def _lamb(guarded: bool) -> Scenario:
    """Task b's weight is warmed up from 0 (a curriculum): at step 0 ``head_b``'s gradient is exactly 0, so is its
    update, and ``|w| / 0`` is inf; ``0 * inf`` writes NaN into the head (its own param group, without decay)."""
    torch.manual_seed(0)
    model = TwoTaskNet()
    opt = Lamb([{"params": [*model.body.parameters(), *model.head_a.parameters()], "weight_decay": 0.01},
                {"params": model.head_b.parameters()}], guarded=guarded)
    xs, ya, yb = _batches(6, 4), _batches(6, 2), _batches(6, 2)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out_a, out_b = model(xs[step])
            loss = F.mse_loss(out_a, ya[step]) + min(step / 2, 1.0) * F.mse_loss(out_b, yb[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a temperature used only in eval, not calibrated yet
class TemperatureScaler(nn.Module):
    """Temperature scaling: the buffer is fitted on held-out data after training (zeros until then, or ones: the
    twin); only ``eval()`` divides by it, training sees raw logits."""

    def __init__(self, initial: float) -> None:
        super().__init__()
        self.register_buffer("temperature", torch.full((), initial))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.training else logits / self.temperature  # producer: temperature


class CalibratedClassifier(nn.Module):
    def __init__(self, initial: float) -> None:
        super().__init__()
        self.net, self.calib = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), TemperatureScaler(initial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.calib(self.net(x))


def _eval_temperature(initial: float) -> Scenario:
    """Training is fine; the validation pass after step 1 (``eval()`` + ``no_grad``, belonging to step 2) divides
    the logits by a temperature of 0 and its softmax is ``inf / inf``; training then resumes in ``train()``."""
    torch.manual_seed(0)
    model = CalibratedClassifier(initial)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys, val = _batches(6, 4), [torch.randint(0, 3, (6,)) for _ in range(4)], torch.randn(5, 4)

    def run() -> list[torch.Tensor]:
        seen = []
        for step in range(4):
            model.train()
            loss = F.cross_entropy(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(loss.detach())
            if step % 2 == 1:
                model.eval()
                with torch.no_grad():
                    seen.append(model(val).softmax(-1).max(-1).values.mean())
        return seen
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a token added by a resize, normalised by hand
class CosineLM(nn.Module):
    """Normalised token embeddings (a contrastive token encoder's), normalised by hand; the head was sized for the
    tokenizer's final vocabulary from the start."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 12)

    def resize_token_embeddings(self, size: int, mean_init: bool) -> None:
        old = self.embed.weight.detach()
        new = torch.zeros(size, old.shape[1])
        new[: old.shape[0]] = old
        if mean_init:
            new[old.shape[0]:] = old.mean(0)  # transformers' default since 4.46: the mean of the old rows
        self.embed = nn.Embedding.from_pretrained(new, freeze=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.embed(tokens)
        e = e / e.norm(dim=-1, keepdim=True)  # producer: embedding norm
        return self.head(torch.tanh(self.mix(e)))


def _resized(mean_init: bool) -> Scenario:
    """Two special tokens are added and the embedding resized with zero rows before fine-tuning; step 2's batch is
    the first to hold one: its normalised embedding is ``0 / 0``. The twin initialises new rows at the mean."""
    torch.manual_seed(0)
    model = CosineLM()
    model.resize_token_embeddings(12, mean_init)
    tokens = [torch.randint(0, 10, (3, 5)) for _ in range(4)]
    tokens[2][1, 2] = 11
    targets = [torch.randint(0, 12, (3, 5)) for _ in range(4)]
    return _loop(model, lambda step: (tokens[step],),
                 lambda out, step: F.cross_entropy(out.flatten(0, 1), targets[step].flatten()))


# ---------------------------------------------------------------- a LightningModule-like training_step
class LitClassifier(nn.Module):
    """A LightningModule's shape: the network is ``self.model``, the loss code lives in ``training_step`` (not
    ``forward``), the loop calls it; the slip takes ``log(softmax)``, the twin ``log_softmax``."""

    def __init__(self, stable: bool) -> None:
        super().__init__()
        self.model, self.stable = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), stable

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        if self.stable:
            return F.nll_loss(F.log_softmax(logits, -1), y)
        return F.nll_loss(torch.log(logits.softmax(-1)), y)  # producer: lit log


def _lightning(stable: bool) -> Scenario:
    """Step 1's batch holds a sample the network is sure is class 0 by a logit margin of about 200 while its label
    is 2: its probability underflows to 0 and the log is -inf."""
    torch.manual_seed(0)
    lit = LitClassifier(stable)
    opt = torch.optim.SGD(lit.parameters(), lr=1e-4)
    xs, ys = _batches(4, 4), [torch.randint(0, 3, (4,)) for _ in range(4)]
    with torch.no_grad():
        lit.model[2].weight.zero_()
        lit.model[2].weight[0] = 1.0
        lit.model[2].bias.zero_()
    xs[1][3] = xs[1][3].abs().clamp(min=0.5) * 0
    xs[1][3] += 1.0
    scale = 200.0 / lit.model(xs[1][3:4]).detach()[0, 0].item()
    xs[1][3] *= scale
    ys[1][3] = 2

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = lit.training_step((xs[step], ys[step]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((lit, opt), run)


# ---------------------------------------------------------------- a best checkpoint reloaded in the middle of the run
def _reload_best(clean: bool) -> Scenario:
    """Early stopping's patience ran out at step 2 and the loop restores the best state with ``load_state_dict``:
    the state kept was read from a checkpoint file another run (diverged in one entry) had written. No watched
    code makes the NaN: the copy passes it on, and the next forward meets the parameter already non-finite, as with
    a checkpoint loaded before training. The twin's best state is clean.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(6, 4), _batches(6, 1)
    best = {k: v.clone() for k, v in model.state_dict().items()}
    if not clean:
        best["2.weight"][0, 5] = float("nan")  # a checkpoint written by a run that had diverged in that entry

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                model.load_state_dict(best)
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a model inside the user's own wrapper
class Encoder(nn.Module):
    """Log-variance head of a VAE encoder; the twin bounds it through softplus."""

    def __init__(self, bounded: bool) -> None:
        super().__init__()
        self.body, self.var, self.bounded = nn.Linear(4, 8), nn.Linear(8, 2), bounded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.var(torch.relu(self.body(x)))
        v = F.softplus(v) + 1e-4 if self.bounded else v
        return torch.log(v)  # producer: wrapped log variance


class Net(nn.Module):
    def __init__(self, bounded: bool) -> None:
        super().__init__()
        self.enc, self.head = Encoder(bounded), nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


class Wrapped(nn.Module):
    """A home-made DataParallel stand-in (``model.module`` is the network): its parameters are ``module.*``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.module(*args)


def _wrapped(bounded: bool) -> Scenario:
    """The variance head's raw output is read as a variance (its bias starts it at 1): step 1 holds an input far off
    the training range (6 where the data lie in [0, 0.5]) whose first variance is below 0, and its log is NaN. The
    twin bounds the variance through softplus."""
    torch.manual_seed(0)
    model = Wrapped(Net(bounded))
    enc = model.module.enc
    with torch.no_grad():
        enc.body.weight.fill_(0.2)
        enc.body.bias.zero_()
        enc.var.weight.fill_(0.1)
        enc.var.weight[0] = -0.2
        enc.var.bias.fill_(1.0)
    xs, ys = [torch.rand(4, 4) * 0.5 for _ in range(4)], _batches(4, 1)
    xs[1][2] = 6.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=1e-4)


CASES = [
    Case("hunt_s27_lamb_trust_ratio_of_a_zero_update_at_step_0", lambda: _lamb(False),
         Expect("optimizer", "head_b", "Linear", step=0, op="aten.div.Tensor", marker="trust ratio",
                cause="division-by-zero")),
    Case("hunt_s27_lamb_trust_ratio_guarded_healthy", lambda: _lamb(True), None),
    Case("hunt_s27_eval_temperature_not_calibrated_in_a_mid_training_validation", lambda: _eval_temperature(0.0),
         Expect("forward", "calib", "TemperatureScaler", step=2, op="aten.div.Tensor", marker="temperature",
                cause="division-by-zero")),
    Case("hunt_s27_eval_temperature_initialised_at_1_healthy", lambda: _eval_temperature(1.0), None),
    Case("hunt_s27_resized_token_embeddings_zero_rows_normalised_by_hand", lambda: _resized(False),
         Expect("forward", "", "CosineLM", step=2, op="aten.div.Tensor", marker="embedding norm",
                cause="division-by-zero")),
    Case("hunt_s27_resized_token_embeddings_mean_rows_healthy", lambda: _resized(True), None),
    Case("hunt_s27_lightning_like_training_step_log_of_an_underflowed_probability", lambda: _lightning(False),
         Expect("forward", None, step=1, op="aten.log.default", marker="lit log", cause="log-domain")),
    Case("hunt_s27_lightning_like_training_step_log_softmax_healthy", lambda: _lightning(True), None),
    Case("hunt_s27_best_checkpoint_reloaded_mid_run_holding_a_nan", lambda: _reload_best(False),
         Expect("forward", "2", "Linear", step=2, op=None, cause="parameter-already-nonfinite")),
    Case("hunt_s27_best_checkpoint_reloaded_mid_run_healthy", lambda: _reload_best(True), None),
    Case("hunt_s27_wrapped_model_module_log_of_a_negative_variance", lambda: _wrapped(False),
         Expect("forward", "module.enc", "Encoder", step=1, op="aten.log.default", marker="wrapped log variance",
                cause="log-domain")),
    Case("hunt_s27_wrapped_model_module_softplus_variance_healthy", lambda: _wrapped(True), None),
]
