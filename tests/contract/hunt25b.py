"""hunt25b, loops, optimizers and data: reported incidents, each with its healthy twin (layers, losses: hunt25).

Loops: test-time adaptation (TENT), entropy minimisation stepped under ``torch.enable_grad()`` inside the evaluation
loop's ``no_grad`` (a softmax saturated to exactly 0: ``p * log p``); scheduled sampling, whose branch feeding the
decoder its own argmax is taken only from step 2 (it picks the padding token, whose embedding row is 0, and the
decoder's input is cosine-normalised: 0 / 0); a gradient hook registered on an auxiliary branch's activation in its
forward, normalising the gradient, under an auxiliary weight of 0; a float16 model under a static loss scale of
65536 (apex's O2 default, no GradScaler to skip the step), whose backward overflows on a batch of outliers.
Optimizers: Shampoo written by hand, the inverse fourth root of a preconditioner that is rank-deficient by
construction (``G G^T`` of a tall gradient) without its epsilon; ``RMSprop(eps=0)`` over an embedding's
``padding_idx`` row, whose gradient is always 0. Data: FCOS centerness targets built in the loop for a
zero-width box (``min(l, r) / max(l, r)`` of 0 / 0); log returns computed in an ``IterableDataset``'s ``__iter__``
over a price series in which a halted stock is reported at 0. Each with the fix its users apply: the twin must stay
silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import loader_loop as _loader_loop
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- TENT: enable_grad inside an evaluation no_grad
def _tent(log_softmax: bool) -> Scenario:
    """Only the BatchNorm affine parameters adapt, one step a test batch, by the entropy of the prediction; a class
    the classifier has ruled out (logit 120 below) has probability exactly 0, and ``p * log p`` is ``0 * -inf``. The
    twin computes ``p * log_softmax``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))
    with torch.no_grad():
        model[3].bias[4] = -120.0
    model.requires_grad_(False)
    adapted = [model[1].weight, model[1].bias]
    for p in adapted:
        p.requires_grad_(True)
    opt = torch.optim.SGD(adapted, lr=1e-3)
    xs = _batches(8, 6)

    def run() -> list[torch.Tensor]:
        predictions = []
        with torch.no_grad():
            for step in range(4):
                with torch.enable_grad():
                    logits = model(xs[step])
                    p = logits.softmax(-1)
                    if log_softmax:
                        entropy = -(p * logits.log_softmax(-1)).sum(-1).mean()
                    else:
                        entropy = -(p * p.log()).sum(-1).mean()  # producer: tent entropy
                    opt.zero_grad()
                    entropy.backward()
                    opt.step()
                predictions.append(logits.argmax(-1))
        return predictions
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- scheduled sampling, its branch from step 2
class CosineInputDecoder(nn.Module):
    """A GRU decoder whose input embeddings are L2-normalised; fed the gold previous token (teacher forcing) or,
    where ``sample``, its own argmax."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.embed, self.cell, self.head = nn.Embedding(10, 8, padding_idx=0), nn.GRUCell(8, 16), nn.Linear(16, 10)
        self.eps = eps
        with torch.no_grad():
            self.head.bias[0] = 6.0  # an undertrained decoder: padding is its most likely token

    def forward(self, tokens: torch.Tensor, sample: bool) -> torch.Tensor:
        h = torch.zeros(tokens.shape[0], 16)
        prev, logits = tokens[:, 0], []
        for t in range(1, tokens.shape[1]):
            e = self.embed(prev)
            e = e / (e.norm(dim=-1, keepdim=True) + self.eps)  # producer: cosine input
            h = self.cell(e, h)
            logits.append(self.head(h))
            prev = logits[-1].argmax(-1) if sample else tokens[:, t]
        return torch.stack(logits, 1)


def _scheduled_sampling(eps: float) -> Scenario:
    """The sampling branch is first taken at step 2; the argmax is the padding token, whose embedding row is 0. The
    twin adds eps to the norm."""
    torch.manual_seed(0)
    model = CosineInputDecoder(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = [torch.randint(1, 10, (3, 5)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            logits = model(tokens[step], sample=step >= 2)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[step][:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a gradient hook on an auxiliary activation
class AuxBranch(nn.Module):
    """An auxiliary branch that normalises the gradient flowing into its activation (against one task dominating)."""

    def __init__(self, eps: float, squashed: bool) -> None:
        super().__init__()
        self.fc, self.eps, self.squashed = nn.Linear(8, 8), eps, squashed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.fc(h)
        if a.requires_grad:
            a.register_hook(lambda g: g / (g.norm() + self.eps))  # producer: aux gradient hook
        return torch.tanh(a) if self.squashed else a


class TwoTask(nn.Module):
    def __init__(self, eps: float, squashed: bool) -> None:
        super().__init__()
        self.trunk, self.aux, self.main = nn.Linear(6, 8), AuxBranch(eps, squashed), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.main(h), self.aux(h)


def _aux_hook(eps: float, squashed: bool = False) -> Scenario:
    """The auxiliary loss is weighted 0 from step 2 (its annealing schedule's end): the gradient into the branch's
    activation is exactly 0 and the hook's ``g / |g|`` is 0 / 0. The activation is the model's output, or
    (``squashed``) one inside the branch, before its tanh. The twin adds eps."""
    torch.manual_seed(0)
    model = TwoTask(eps, squashed)
    xs, ys, aux_ys = _batches(6, 6), _batches(6, 1), _batches(6, 8)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        main, aux = out
        weight = max(0.0, 1.0 - step / 2)
        return F.mse_loss(main, ys[step]) + weight * F.mse_loss(aux, aux_ys[step])
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a float16 model, a static loss scale
def _static_loss_scale(scale: float) -> Scenario:
    """A model cast to float16 with its loss multiplied by a static scale (apex O2's 65536) and its gradients divided
    back before SGD; the first backward overflows the last layer's bias gradient (a sum over the batch). No GradScaler
    skips the step. The twin's scale is 128."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    xs, ys = _batches(16, 8), _batches(16, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step].half()).float(), ys[step])  # producer: half model call
            opt.zero_grad()
            (loss * scale).backward()
            for p in model.parameters():
                p.grad.div_(scale)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- Shampoo by hand, without its epsilon
class HandShampoo(torch.optim.Optimizer):
    """Shampoo (Gupta et al.): a matrix's update ``L^-1/4 G R^-1/4`` with ``L = sum G G^T`` and ``R = sum G^T G``;
    the inverse roots by ``eigh``, ``(lambda + eps)^-1/4``. Vectors step by SGD."""

    def __init__(self, params, lr: float, eps: float) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @staticmethod
    def _inverse_root(mat: torch.Tensor, eps: float) -> torch.Tensor:
        vals, vecs = torch.linalg.eigh(mat)
        return vecs @ torch.diag((vals + eps).pow(-0.25)) @ vecs.T  # producer: inverse root

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() < 2:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                state = self.state[p]
                if not state:
                    state["L"], state["R"] = torch.zeros(p.shape[0], p.shape[0]), torch.zeros(p.shape[1], p.shape[1])
                state["L"].add_(p.grad @ p.grad.T)
                state["R"].add_(p.grad.T @ p.grad)
                update = self._inverse_root(state["L"], group["eps"]) @ p.grad @ self._inverse_root(
                    state["R"], group["eps"])
                p.add_(update, alpha=-group["lr"])
        return None


def _shampoo(eps: float) -> Scenario:
    """``L`` of the 8x4 first weight has rank 4 at most: four of its eigenvalues are 0 up to rounding, some a little
    below, and ``lambda^-1/4`` of those is NaN. The twin adds Shampoo's epsilon, 1e-4."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = HandShampoo(model.parameters(), lr=0.01, eps=eps)
    xs, ys = _batches(6, 4), _batches(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- RMSprop(eps=0) over a padding_idx row
def _rmsprop_padding(eps: float) -> Scenario:
    """An ``nn.Embedding(padding_idx=0)`` under ``RMSprop(eps=0)``: the padding row's gradient is always 0, its
    square average 0, its update 0 / 0 at the first step. The twin keeps RMSprop's eps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, 1))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, eps=eps)
    tokens = [torch.randint(0, 8, (5, 3)) for _ in range(3)]
    ys = _batches(5, 1, steps=3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(tokens[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: rmsprop step
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- FCOS centerness targets of a zero-width box
def _centerness(guarded: bool) -> Scenario:
    """Centerness targets ``sqrt(min(l, r) / max(l, r) * min(t, b) / max(t, b))`` built in the loop from each
    location's distances to its box; the annotation of step 1 holds a zero-width box (a location on it has l = r =
    0). The twin clamps the maxima, as FCOS implementations filter degenerate boxes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    xs = _batches(6, 4)
    ltrb = [torch.rand(6, 4) * 5 + 0.5 for _ in range(4)]
    ltrb[1][3, 0] = ltrb[1][3, 2] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            left, top, right, bottom = ltrb[step].unbind(-1)
            horizontal, vertical = torch.minimum(left, right), torch.minimum(top, bottom)
            lr_max, tb_max = torch.maximum(left, right), torch.maximum(top, bottom)
            if guarded:
                lr_max, tb_max = lr_max.clamp(min=1e-6), tb_max.clamp(min=1e-6)
            target = torch.sqrt(horizontal / lr_max * (vertical / tb_max))  # producer: centerness
            loss = F.binary_cross_entropy_with_logits(model(xs[step]).squeeze(-1), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- log returns in an IterableDataset
class ReturnStream(torch.utils.data.IterableDataset):
    """Windows of log returns, ``log(p_t / p_t-1)``, over a price series, the last the target; the exchange reports a
    halted stock at 0. ``starts``: where each window begins (apart, or sliding by a day)."""

    def __init__(self, filled: bool, starts: range) -> None:
        g = torch.Generator().manual_seed(2)
        self.prices = 100 * torch.exp(torch.randn(48, generator=g).mul(0.02).cumsum(0))
        self.prices[32] = 0.0
        if filled:
            self.prices[32] = self.prices[31]  # the halted day forward-filled
        self.starts = starts

    def __iter__(self):
        for i in self.starts:
            window = self.prices[i:i + 6]
            returns = torch.log(window[1:] / window[:-1])  # producer: log returns
            yield returns[:-1], returns[-1:]


def _returns(filled: bool, starts: range = range(0, 48, 6)) -> Scenario:
    """Windows six days apart: the halted day falls inside the inputs of step 2's batch, ``p / 0`` is inf. Sliding
    by a day (from day 20): it is the last day of step 3's last window, only its target is ``log(0 / p)``, -inf.
    The twin forward-fills the halted day."""
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(ReturnStream(filled, starts), batch_size=2)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> list[torch.Tensor]:
        losses = []
        for x, y in loader:
            loss = F.mse_loss(model(x * 50), y * 50)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a log-duration target in __getitem__
class Events(torch.utils.data.Dataset):
    """Clips with a log-duration regression target, ``log(end - start)``; one annotation's event has no length."""

    def __init__(self, floor: float) -> None:
        g = torch.Generator().manual_seed(4)
        self.features = torch.randn(8, 5, generator=g)
        self.start = torch.rand(8, generator=g) * 10
        self.end = self.start + torch.rand(8, generator=g) * 3 + 0.1
        self.end[5] = self.start[5]  # an annotator's click on the event's start twice
        self.floor = floor

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        duration = (self.end[i] - self.start[i]).clamp(min=self.floor)
        return self.features[i], torch.log(duration)[None]  # producer: log duration


def _log_duration(floor: float) -> Scenario:
    """Sample 5 is in step 2's batch: its target is log 0, -inf, read by the loss alone. The twin floors the duration
    at a frame (0.04 s)."""
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(Events(floor), batch_size=2)
    return _loader_loop(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)), loader, F.smooth_l1_loss)


# ---------------------------------------------------------------- a flat step written by vector_to_parameters
def _flat_step(eps: float) -> Scenario:
    """Normalised gradient descent on the flattened parameters, written back by ``vector_to_parameters`` (which
    rebinds each ``.data``: no op on the parameter); the batch of step 2 is weighted 0 (all its samples filtered),
    every gradient is 0 and the step ``g / |g|`` is 0 / 0. The twin adds eps to the norm."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    xs, ys = _batches(6, 4), _batches(6, 1)
    weights = [1.0, 1.0, 0.0, 1.0]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = weights[step] * F.mse_loss(model(xs[step]), ys[step])
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                flat = nn.utils.parameters_to_vector(model.parameters())
                grad = nn.utils.parameters_to_vector(p.grad for p in model.parameters())
                update = grad / (grad.norm() + eps)  # producer: flat step
                nn.utils.vector_to_parameters(flat - 0.05 * update, model.parameters())
            losses.append(loss.detach())
        return losses
    return Scenario((model,), run)


# ---------------------------------------------------------------- a precision metric of no predicted positive
def _precision_metric() -> Scenario:
    """A detector's precision logged each step, ``tp / predicted positives``: at step 1 the classifier predicts no
    positive and the metric is 0 / 0, NaN. A logged metric is no boundary: nothing to report, in any mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(8, 6), [(torch.rand(8, 1) > 0.5).float() for _ in range(4)]
    shifts = [0.0, -30.0, 0.0, 0.0]

    def run() -> list[torch.Tensor]:
        logged = []
        for step in range(4):
            logits = model(xs[step]) + shifts[step]
            loss = F.binary_cross_entropy_with_logits(logits, ys[step])
            predicted = logits.detach() > 0
            precision = (predicted & (ys[step] > 0)).sum() / predicted.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            logged.append(torch.stack((loss.detach(), precision)))
        return logged
    return Scenario((model, opt), run)


CASES = [
    Case("hunt25b_tent_entropy_under_enable_grad_of_a_ruled_out_class", lambda: _tent(False),
         Expect("forward", None, step=0, op="aten.log.default", marker="tent entropy", cause="log-domain")),
    Case("hunt25b_tent_entropy_by_log_softmax_healthy", lambda: _tent(True), None),
    Case("hunt25b_scheduled_sampling_branch_feeds_the_padding_token", lambda: _scheduled_sampling(0.0),
         Expect("forward", "", "CosineInputDecoder", step=2, op="aten.div.Tensor", marker="cosine input",
                cause="division-by-zero")),
    Case("hunt25b_scheduled_sampling_norm_eps_healthy", lambda: _scheduled_sampling(1e-6), None),
    Case("hunt25b_gradient_hook_in_forward_normalises_a_zero_aux_gradient", lambda: _aux_hook(0.0),
         Expect("backward", "aux", "AuxBranch", step=2, op="aten.div.Tensor", marker="aux gradient hook",
                cause="division-by-zero")),
    Case("hunt25b_gradient_hook_in_forward_eps_healthy", lambda: _aux_hook(1e-12), None),
    Case("hunt25b_gradient_hook_on_an_inner_activation_normalises_a_zero_gradient", lambda: _aux_hook(0.0, True),
         Expect("backward", "aux", "AuxBranch", step=2, op="aten.div.Tensor", marker="aux gradient hook",
                cause="division-by-zero")),
    Case("hunt25b_gradient_hook_on_an_inner_activation_eps_healthy", lambda: _aux_hook(1e-12, True), None),
    Case("hunt25b_float16_static_loss_scale_65536_overflows_the_first_backward", lambda: _static_loss_scale(65536.0),
         Expect("backward", "4", "Linear", step=0, op="aten.sum.dim_IntList", marker="half model call",
                tensor=TensorRef.gradient("4.bias"), cause="half-precision-overflow")),
    Case("hunt25b_float16_static_loss_scale_128_healthy", lambda: _static_loss_scale(128.0), None),
    Case("hunt25b_hand_shampoo_inverse_root_of_a_rank_deficient_preconditioner", lambda: _shampoo(0.0),
         Expect("optimizer", "0", "Linear", step=0, op="aten.pow.Tensor_Scalar", marker="inverse root",
                tensor=TensorRef.parameter("0.weight"), cause="pow-domain")),
    Case("hunt25b_hand_shampoo_with_epsilon_healthy", lambda: _shampoo(1e-4), None),
    Case("hunt25b_rmsprop_eps_0_over_a_padding_idx_row", lambda: _rmsprop_padding(0.0),
         Expect("optimizer", "0", "Embedding", step=0, op="aten.addcdiv_.default", marker="rmsprop step",
                tensor=TensorRef.parameter("0.weight"), cause="optimizer-eps-underflow")),
    Case("hunt25b_rmsprop_default_eps_padding_idx_healthy", lambda: _rmsprop_padding(1e-8), None),
    Case("hunt25b_fcos_centerness_targets_of_a_zero_width_box_built_in_the_loop", lambda: _centerness(False),
         Expect("data", None, step=1, op="aten.div.Tensor", marker="centerness", cause="division-by-zero"),
         # The recorded modes tell it by the data code's records (recorded_ops.made_from_outside_data: every
         # tensor its ops read is plain, none a parameter or a model's output: not the hunt24 center loss's centers
         # nor its unwatched teacher's output). The live op tracer carries the same lineage as a taint
         # (localize/ops/derived.py): no tensor its op read was made from a parameter or a model output.
         ),
    Case("hunt25b_fcos_centerness_maxima_clamped_healthy", lambda: _centerness(True), None),
    Case("hunt25b_iterable_dataset_log_returns_of_a_halted_price_of_0", lambda: _returns(False),
         Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="log returns",
                cause="division-by-zero")),
    Case("hunt25b_iterable_dataset_halted_price_forward_filled_healthy", lambda: _returns(True), None),
    Case("hunt25b_iterable_dataset_target_return_of_a_halted_price_of_0", lambda: _returns(False, range(20, 28)),
         Expect("data", None, step=3, op="aten.log.default", marker="log returns", cause="log-domain")),
    Case("hunt25b_iterable_dataset_sliding_halted_price_forward_filled_healthy",
         lambda: _returns(True, range(20, 28)), None),
    Case("hunt25b_getitem_log_duration_target_of_a_zero_length_event", lambda: _log_duration(0.0),
         Expect("data", None, step=2, op="aten.log.default", marker="log duration", cause="log-domain")),
    Case("hunt25b_getitem_log_duration_floored_healthy", lambda: _log_duration(0.04), None),
    Case("hunt25b_flat_normalised_step_by_vector_to_parameters_of_a_zero_gradient", lambda: _flat_step(0.0),
         Expect("optimizer", "0", "Linear", step=2, op="aten.div.Tensor", marker="flat step",
                tensor=TensorRef.parameter("0.weight"), cause="division-by-zero")),
    Case("hunt25b_flat_normalised_step_by_vector_to_parameters_eps_healthy", lambda: _flat_step(1e-12), None),
    Case("hunt25b_precision_metric_of_no_predicted_positive_is_no_event_healthy", _precision_metric, None),
]
