"""hunt24, training-loop shapes: reported incidents, each with its healthy twin (layers, losses, data: hunt24b).

One model split by parameter name over two optimizers, its normalisation parameters in an ``Adam(eps=0)`` stepped
after the body's SGD, under a zero-initialised head (their gradient is exactly 0 at step 0); multi-task uncertainty
weights kept as free tensors outside the model (Kendall's ``sigma`` parametrisation) in the model's own optimizer,
one pushed below 0 before ``log(sigma)``; a soft prompt, a free tensor outside any module and optimizer, stepped by
hand with each slot's gradient normalised (a masked slot: 0 / |0|; the deferred check judges that batch after the
next call's loss region began); self-conditioning, a second model call a step fed by the first one's prediction
normalised in the loop; distillation from a teacher not given to the watch, run under no_grad before the student (a
blank sample: the teacher's hand L2 normalisation, 0 / |0|); a center loss whose centers, a plain tensor, the loop
moves after the optimizer step toward each class's batch mean (a class absent from the batch: the mean of nothing,
read NaN by the next step's loss). At the loop's last step, where nothing runs after it: ``F.gumbel_softmax`` with
its temperature annealed to 0; a token loss normalised by ``loss * (1 / n_valid)`` over a batch of padding only; a
GeM pooling without its eps whose backward meets an all-zero channel, the NaN gradient spread over every parameter
by ``clip_grad_norm_(error_if_nonfinite=False)`` (the finite loss shows nothing); an auxiliary head switched on with
a weight of 0 under ``Adam(eps=0)`` (only the parameters show it). Each with the fix its users apply: the twin must
stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- two optimizers, split by parameter name
class NormedMlp(nn.Module):
    """A LayerNorm-ed body and a zero-initialised head (as residual and classifier heads often are)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.norm, self.head = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 1)
        nn.init.zeros_(self.head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.body(x))))


def _two_optimizers(eps: float) -> Scenario:
    """The parameters whose name holds "norm" go to an Adam with eps=0 ("as in the paper"), the rest to SGD; the
    head's weight is 0 at step 0, so the LayerNorm's gradient is exactly 0 and Adam's first update is 0 / 0. The
    twin keeps Adam's eps."""
    torch.manual_seed(0)
    model = NormedMlp()
    named = list(model.named_parameters())
    body_opt = torch.optim.SGD([p for n, p in named if "norm" not in n], lr=0.05)
    norm_opt = torch.optim.Adam([p for n, p in named if "norm" in n], lr=1e-3, eps=eps)
    xs, ys = _batches(8, 6), _batches(8, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            body_opt.zero_grad()
            norm_opt.zero_grad()
            loss.backward()
            body_opt.step()
            norm_opt.step()  # producer: norm adam step
            losses.append(loss.detach())
        return losses
    return Scenario((model, body_opt, norm_opt), run)


# ---------------------------------------------------------------- uncertainty weights as free tensors
def _free_sigma(log_parametrised: bool) -> Scenario:
    """Two task losses weighted by learned uncertainties kept outside the model, ``L / (2 sigma^2) + log sigma``,
    in the model's own optimizer. The regression task is nearly solved, so the gradient on its sigma is ``1 / sigma``
    and the step of step 1 carries sigma below 0: ``log(sigma)`` of step 2 is NaN. The twin learns ``log sigma^2``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 4))
    init = torch.tensor([0.6, 0.12])
    weights = nn.Parameter(torch.log(init ** 2) if log_parametrised else init.clone())
    opt = torch.optim.SGD([*model.parameters(), weights], lr=0.01)
    xs, labels = _batches(8, 5), [torch.randint(0, 3, (8,)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out = model(xs[step])
            task = torch.stack([F.cross_entropy(out[:, :3], labels[step]), 1e-4 * out[:, 3].pow(2).mean()])
            if log_parametrised:
                loss = (task * torch.exp(-weights) / 2 + weights / 2).sum()
            else:
                loss = (task / (2 * weights ** 2) + torch.log(weights)).sum()  # producer: log sigma
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- gumbel_softmax annealed to tau 0
class DiscreteBottleneck(nn.Module):
    """A categorical bottleneck sampled by ``F.gumbel_softmax``; its temperature is set by the loop each step."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec, self.tau = nn.Linear(6, 5), nn.Linear(5, 6), 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = F.gumbel_softmax(self.enc(x), tau=self.tau)  # producer: gumbel softmax
        return self.dec(code)


def _gumbel(floor: float) -> Scenario:
    """The temperature is annealed linearly to 0 over the run (``1 - step / (steps - 1)``); at the last step it is
    exactly 0 and the logits divided by it are +-inf: softmax of them is NaN. The twin anneals to a floor."""
    torch.manual_seed(0)
    model = DiscreteBottleneck()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = _batches(8, 6)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            model.tau = max(floor, 1.0 - step / 3)
            torch.manual_seed(step)  # gumbel_softmax draws its noise: the same draws in every run
            loss = F.mse_loss(model(xs[step]), xs[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- GeM pooling without eps, then clip_grad_norm_
class GemPool(nn.Module):
    """Generalised-mean pooling ``mean(x^p)^(1/p)`` (Radenovic et al.); cirtorch clamps x at eps=1e-6 first."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.p, self.eps = nn.Parameter(torch.tensor(3.0)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = x.clamp(min=self.eps).pow(self.p).mean((2, 3))
        return pooled.pow(1.0 / self.p)  # producer: gem root


class RetrievalNet(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.conv, self.gem, self.head = nn.Conv2d(1, 4, 3), GemPool(eps), nn.Linear(4, 3)
        with torch.no_grad():
            self.conv.weight.abs_()  # light makes every channel fire
            self.conv.bias.fill_(0.1)
            self.conv.bias[2] = -1e-3  # and is 0 wherever the image is blank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gem(F.relu(self.conv(x))))


def _gem_clipped(eps: float) -> Scenario:
    """At step 3, the last, a blank image makes channel 2 exactly 0 everywhere: the root's backward is
    ``0 ** (1/p - 1)``, inf, and the power's backward multiplies it by 0. The loop clips with
    ``error_if_nonfinite=False``, which multiplies every gradient by the NaN norm's coefficient. The twin clamps at
    eps."""
    torch.manual_seed(0)
    model = RetrievalNet(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, labels = [torch.rand(4, 1, 6, 6) for _ in range(4)], [torch.randint(0, 3, (4,)) for _ in range(4)]
    xs[3][1] = 0.0  # a blank image, in the run's last batch: only the gradients and parameters show it

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.cross_entropy(model(xs[step]), labels[step])
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=False)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- loss * (1 / n_valid) at the last step
def _reciprocal_count(clamped: bool) -> Scenario:
    """A token loss summed over the valid tokens and normalised by ``loss * (1 / n_valid)``; the loop's last batch
    is all padding (a bucket's leftover): n_valid is 0, 1 / 0 is inf and the sum 0 times it NaN. The twin clamps
    the count at 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    tokens = [torch.randint(0, 10, (4, 5)) for _ in range(4)]
    valid = [torch.rand(4, 5) > 0.2 for _ in range(4)]
    valid[3][:] = False

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        ce = F.cross_entropy(logits.flatten(0, 1), tokens[step].roll(-1, 1).flatten(), reduction="none")
        mask = valid[step].flatten().float()
        n_valid = mask.sum().clamp(min=1) if clamped else mask.sum()
        return (ce * mask).sum() * (1 / n_valid)  # producer: reciprocal count
    return _loop(model, lambda step: (tokens[step],), loss_fn)


# ---------------------------------------------------------------- an auxiliary head switched on at the last step
class AuxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.main, self.aux = nn.Linear(5, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.main(h), self.aux(h)


def _aux_last_step(eps: float) -> Scenario:
    """A curriculum switches the auxiliary loss on at the last step, its weight ramping from 0: the aux head's
    first gradient is exactly 0 and Adam(eps=0)'s first update of it 0 / 0. Nothing runs after that step: only
    the parameters the watch reads at its exit show it. The twin keeps Adam's eps."""
    torch.manual_seed(0)
    model = AuxNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    xs, ys, aux_ys = _batches(8, 5), _batches(8, 1), _batches(8, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            main, aux = model(xs[step])
            loss = F.mse_loss(main, ys[step])
            if step == 3:
                loss = loss + 0.0 * F.mse_loss(aux, aux_ys[step])  # the ramp's first value
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: aux adam step
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- soft prompt tuning by a hand normalised step
class FrozenEncoder(nn.Module):
    """A frozen encoder that reads a soft prompt before the input tokens; prompt slots the mask leaves out have no
    gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.requires_grad_(False)

    def forward(self, prompt: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        h = torch.cat([(prompt * slots[:, None]).expand(tokens.shape[0], -1, -1), self.embed(tokens)], 1)
        return self.head(torch.tanh(self.mix(h)).mean(1))


def _soft_prompt(eps: float) -> Scenario:
    """The prompt is a free tensor, outside any module and any optimizer: the loop steps it by hand, each slot's
    gradient normalised to unit length. Slot 3 is switched off by the prompt's mask (a shorter prompt for this
    task), its gradient is exactly 0, and 0 / |0| is NaN: the prompt of step 1 is NaN. The twin adds eps."""
    torch.manual_seed(0)
    model = FrozenEncoder()
    prompt = torch.randn(4, 6, requires_grad=True)
    slots = torch.tensor([1.0, 1.0, 1.0, 0.0])
    tokens, labels = [torch.randint(0, 10, (5, 3)) for _ in range(4)], [torch.randint(0, 2, (5,)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.cross_entropy(model(prompt, tokens[step], slots), labels[step])
            (g,) = torch.autograd.grad(loss, prompt)
            with torch.no_grad():
                prompt.sub_(0.1 * g / (g.norm(dim=-1, keepdim=True) + eps))  # producer: prompt step
            losses.append(loss.detach())
        return losses
    return Scenario((model,), run)


# ---------------------------------------------------------------- self-conditioning: a second call fed by the first
class Refiner(nn.Module):
    """A denoiser whose ReLU output head predicts a non-negative residual, called twice a step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 6), nn.ReLU())

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, cond], -1))


def _self_conditioning(eps: float) -> Scenario:
    """Self-conditioning (as in Bit Diffusion): a first call with a zero condition, its prediction, detached and
    normalised per sample, the condition of a second call whose output is trained. At step 1 a sample's first
    prediction is all 0 (the ReLU head, its weights negative, is off for it): 0 / |0| is NaN, made by the loop
    between the two calls of one step. The twin adds eps to the norm."""
    torch.manual_seed(0)
    model = Refiner()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(5, 6), _batches(5, 6)
    with torch.no_grad():
        model.net[2].bias.fill_(0.5)
    with torch.no_grad():
        model.net[2].weight.copy_(-model.net[2].weight.abs())
        model.net[0].weight.copy_(model.net[0].weight.abs())

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            x = xs[step]
            first = model(x, torch.zeros_like(x)).detach()
            cond = first / (first.norm(dim=-1, keepdim=True) + eps)  # producer: self condition
            loss = F.mse_loss(model(x, cond), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- center loss: centers a free tensor, updated by hand
class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return features, self.head(features)


def _center_loss(guarded: bool) -> Scenario:
    """Center loss (Wen et al.) with its centers a plain tensor the loop moves toward each class's batch mean after
    the optimizer step, as the paper's update does; the batch of step 1 holds no sample of class 2: the mean of its
    empty selection is 0 / 0, and the center is NaN from then on (step 2's loss reads it). The twin skips a class
    absent from the batch."""
    torch.manual_seed(0)
    model = Embedder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    centers = torch.zeros(3, 8)
    xs = _batches(6, 6)
    labels = [torch.tensor([0, 1, 2, 0, 1, 2]) for _ in range(4)]
    labels[1] = torch.tensor([0, 1, 0, 1, 0, 1])

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            y = labels[step]
            features, logits = model(xs[step])
            loss = F.cross_entropy(logits, y) + 0.1 * ((features - centers[y]) ** 2).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for c in range(3):
                    members = features[y == c]
                    if guarded and not len(members):
                        continue
                    centers[c] += 0.5 * (members.mean(0) - centers[c])  # producer: center update
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an unwatched teacher before the student's call
class CosineTeacher(nn.Module):
    """A frozen metric-learning teacher: features L2-normalised by hand against class prototypes."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.body, self.prototypes, self.eps = nn.Linear(6, 8, bias=False), nn.Parameter(torch.randn(3, 8)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        h = h / (h.norm(dim=-1, keepdim=True) + self.eps)  # producer: teacher normalise
        return 10 * h @ F.normalize(self.prototypes, dim=-1).T


def _unwatched_teacher(eps: float) -> Scenario:
    """Distillation where only the student and its optimizer are given to the watch; the teacher runs under
    ``no_grad`` before the student's call. A blank sample (all zeros) at step 2 makes the teacher's bias-free feature 0:
    0 / |0|, its soft targets NaN. The twin adds eps to the teacher's norm."""
    torch.manual_seed(0)
    teacher = CosineTeacher(eps).requires_grad_(False)
    student = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    xs = _batches(5, 6)
    xs[2][4] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            with torch.no_grad():
                soft = F.softmax(teacher(xs[step]) / 2.0, -1)
            loss = F.kl_div(F.log_softmax(student(xs[step]) / 2.0, -1), soft, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((student, opt), run)


CASES = [
    Case("hunt24_two_optimizers_by_name_adam_eps0_over_a_zero_gradient_norm", lambda: _two_optimizers(0.0),
         Expect("optimizer", "norm", "LayerNorm", step=0, op="aten.addcdiv_.default", marker="norm adam step",
                tensor=TensorRef.parameter("norm.weight"), cause="optimizer-eps-underflow")),
    Case("hunt24_two_optimizers_by_name_adam_eps_healthy", lambda: _two_optimizers(1e-8), None),
    Case("hunt24_free_uncertainty_sigma_pushed_below_0", lambda: _free_sigma(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="log sigma", cause="log-domain")),
    Case("hunt24_free_uncertainty_log_variance_healthy", lambda: _free_sigma(True), None),
    Case("hunt24_gumbel_softmax_tau_annealed_to_0_at_the_last_step", lambda: _gumbel(0.0),
         Expect("forward", "", "DiscreteBottleneck", step=3, op="aten.div.Tensor", marker="gumbel softmax",
                cause="division-by-zero")),
    Case("hunt24_gumbel_softmax_tau_floor_healthy", lambda: _gumbel(0.1), None),
    Case("hunt24_gem_pool_without_eps_backward_of_a_zero_channel_clipped", lambda: _gem_clipped(0.0),
         Expect("backward", "gem", "GemPool", step=3, op="aten.pow.Tensor_Tensor", marker="gem root",
                cause="pow-domain")),
    Case("hunt24_gem_pool_eps_clipped_healthy", lambda: _gem_clipped(1e-6), None),
    Case("hunt24_loss_times_reciprocal_of_zero_valid_tokens", lambda: _reciprocal_count(False),
         Expect("forward", None, step=3, op="aten.reciprocal.default", marker="reciprocal count",
                cause="division-by-zero")),
    Case("hunt24_loss_times_reciprocal_clamped_healthy", lambda: _reciprocal_count(True), None),
    Case("hunt24_aux_head_switched_on_at_the_last_step_adam_eps0", lambda: _aux_last_step(0.0),
         Expect("optimizer", "aux", "Linear", step=3, op="aten.addcdiv_.default", marker="aux adam step",
                tensor=TensorRef.parameter("aux.weight"), cause="optimizer-eps-underflow")),
    Case("hunt24_aux_head_switched_on_at_the_last_step_adam_eps_healthy", lambda: _aux_last_step(1e-8), None),
    Case("hunt24_soft_prompt_hand_normalised_step_of_a_masked_slot", lambda: _soft_prompt(0.0),
         Expect("data", "", "FrozenEncoder", step=1, op="aten.div.Tensor", marker="prompt step",
                cause="division-by-zero")),
    Case("hunt24_soft_prompt_hand_normalised_step_eps_healthy", lambda: _soft_prompt(1e-12), None),
    Case("hunt24_self_conditioning_normalised_first_prediction_of_0", lambda: _self_conditioning(0.0),
         Expect("data", "", "Refiner", step=1, op="aten.div.Tensor", marker="self condition",
                cause="division-by-zero")),
    Case("hunt24_self_conditioning_eps_healthy", lambda: _self_conditioning(1e-6), None),
    Case("hunt24_center_loss_free_centers_mean_of_an_absent_class", lambda: _center_loss(False),
         Expect("forward", None, step=2, op="aten.mean.dim", marker="center update", cause="empty-reduction")),
    Case("hunt24_center_loss_absent_class_skipped_healthy", lambda: _center_loss(True), None),
    Case("hunt24_unwatched_teacher_normalises_a_blank_sample", lambda: _unwatched_teacher(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="teacher normalise", cause="division-by-zero")),
    Case("hunt24_unwatched_teacher_norm_eps_healthy", lambda: _unwatched_teacher(1e-6), None),
]
