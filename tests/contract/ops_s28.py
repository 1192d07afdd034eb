"""ops_s28, the phase of a value the loop built before the model's call: data, or the model's?

PRODUCT.md's ``data`` is a value "built in the loop from outside data": no parameter nor model output in it. Each row's
producer runs in the loop's data region (after the optimizer's step, before the next model call), outside every
watched module, and reaches the loss; what it read decides the phase. Not data: a model output the loop detached
(its own soft targets), an unwatched frozen teacher's output under ``no_grad``, a running statistic of the model's
features, a mask from the model's prediction. Data: an augmentation of the batch (its targets), a target from a lookup
table indexed by the batch's labels. ops=True tells them apart by the op tracer's taint (localize/ops/derived.py), the
recorded modes by the data region's records (outside/recorded_ops.made_from_outside_data), with the taint carried
through the loss region's records of the step before (what its code detached). Each with its healthy twin.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario


def _loop(model: nn.Module, steps: int, before, loss_of, after=None) -> Scenario:
    """SGD over ``steps`` steps: ``before(step)`` (the data region's code) then ``loss_of(model, step, built)``,
    backward, step, and ``after(step, out)`` (what the loop keeps of the step for the next one)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(steps):
            built = before(step)
            loss, out = loss_of(model, step, built)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if after is not None:
                after(step, out)
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- soft targets from the model's own detached output
def _own_soft_targets(eps: float) -> Scenario:
    """Self-training: the next step's targets are the model's last prediction, detached in the step that made it and
    sharpened into a distribution by the loop (``p / p.sum()``). A bias-free model gives a blank sample (all zeros)
    of step 1 a zero prediction: step 2's sharpening is 0 / 0. The twin adds eps to the sum."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3, bias=False)
    xs = [torch.randn(5, 6) for _ in range(4)]
    xs[1][2] = 0.0
    kept: dict[str, torch.Tensor] = {"p": torch.full((5, 3), 1.0)}

    def before(step: int) -> torch.Tensor:
        p = kept["p"]
        return p / (p.sum(-1, keepdim=True) + eps)  # producer: own soft targets

    def loss_of(model: nn.Module, step: int, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(xs[step])
        kept["p"] = out.detach().square()  # (in the step: the model's output, detached)
        return F.mse_loss(out.softmax(-1), target), out

    return _loop(model, 4, before, loss_of)


# ---------------------------------------------------------------- an unwatched teacher's output, normalised in the loop
def _teacher_targets(eps: float) -> Scenario:
    """Distillation from a frozen teacher that only the student's watch leaves out, run under ``no_grad`` in the
    loop's data region; the loop normalises its squared features into target weights. A blank sample of step 2 gives
    the bias-free teacher zero features: 0 / 0. The twin adds eps."""
    torch.manual_seed(0)
    teacher = nn.Linear(6, 4, bias=False).requires_grad_(False)
    student = nn.Linear(6, 4)
    xs = [torch.randn(5, 6) for _ in range(4)]
    xs[2][1] = 0.0

    def before(step: int) -> torch.Tensor:
        with torch.no_grad():
            h = teacher(xs[step]).square()
        return h / (h.sum(-1, keepdim=True) + eps)  # producer: teacher weights

    def loss_of(model: nn.Module, step: int, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(xs[step])
        return F.mse_loss(out.softmax(-1), target), out

    return _loop(student, 4, before, loss_of)


def _teacher_through_a_buffer(eps: float) -> Scenario:
    """The teacher row with its features written into a slice of a preallocated buffer (``buf[:, :4] = h``) and
    read back through a new view of it: the write marks the buffer, not only the slice it went through."""
    torch.manual_seed(0)
    teacher = nn.Linear(6, 4, bias=False).requires_grad_(False)
    student = nn.Linear(6, 4)
    xs = [torch.randn(5, 6) for _ in range(4)]
    xs[2][1] = 0.0
    buf = torch.zeros(5, 8)

    def before(step: int) -> torch.Tensor:
        with torch.no_grad():
            buf[:, :4] = teacher(xs[step]).square()
        h = buf[:, :4]
        return h / (h.sum(-1, keepdim=True) + eps)  # producer: teacher buffer weights

    def loss_of(model: nn.Module, step: int, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(xs[step])
        return F.mse_loss(out.softmax(-1), target), out

    return _loop(student, 4, before, loss_of)


def _refilled_buffer(eps: float) -> Scenario:
    """A target buffer that held the model's prediction once (after step 0) and is filled from the annotations
    (``copy_``) before each later step: what it holds then is outside data again. A blank annotation row of step 2
    normalised: 0 / 0, data. The twin adds eps."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    xs, ys = [torch.randn(5, 6) for _ in range(4)], [torch.rand(5, 3) for _ in range(4)]
    ys[2][1] = 0.0
    buf = torch.ones(5, 3)

    def before(step: int) -> torch.Tensor:
        if step > 0:
            buf.copy_(ys[step])
        return buf / (buf.sum(-1, keepdim=True) + eps)  # producer: refilled buffer targets

    def loss_of(model: nn.Module, step: int, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(xs[step])
        return F.mse_loss(out.softmax(-1), target), out

    def after(step: int, out: torch.Tensor) -> None:
        if step == 0:
            buf.copy_(out.detach().softmax(-1))  # (the buffer's first use: the model's own prediction)

    return _loop(model, 4, before, loss_of, after)


# ---------------------------------------------------------------- a running statistic of the model's features
class Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU()), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return features, self.head(features)


def _running_feature_scale(eps: float) -> Scenario:
    """A feature-matching loss scaled by the inverse of the features' running mean square, which the loop moves
    under ``no_grad`` after each step (momentum 0.5) and inverts before the next call. The batch of step 0 is blank:
    the statistic is 0, and step 1's inverse is 1 / 0. The twin adds eps."""
    torch.manual_seed(0)
    model = Features()
    xs = [torch.randn(5, 6) for _ in range(4)]
    xs[0].zero_()
    ys = [torch.randn(5, 1) for _ in range(4)]
    running = {"ms": torch.zeros(())}

    def before(step: int) -> torch.Tensor:
        return 1.0 / (running["ms"] + eps) if step else torch.ones(())  # producer: inverse running scale

    def loss_of(model: nn.Module, step: int, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features, out = model(xs[step])
        return F.mse_loss(out, ys[step]) + 1e-3 * scale * features.square().mean(), features

    def after(step: int, features: torch.Tensor) -> None:
        with torch.no_grad():
            running["ms"] = 0.5 * running["ms"] + 0.5 * features.square().mean()

    return _loop(model, 4, before, loss_of, after)


# ---------------------------------------------------------------- a mask from the model's prediction
def _hard_example_weights(keep_all: bool) -> Scenario:
    """Hard-example mining: the loop weights the next step's samples by the last step's mistakes, ``hard / hard.sum()``
    from a mask taken in the step of ``logits.argmax(1) != y``. A model that gets all of step 1 right leaves no hard
    example: step 2's weights are 0 / 0. The twin falls back to every sample where none is hard."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]))
        model.bias.zero_()
    xs = [torch.randn(6, 4) for _ in range(4)]
    ys = [torch.randint(0, 2, (6,)) for _ in range(4)]
    xs[1][:, 0] = xs[1][:, 0].sign() * 5  # (far from the boundary: step 0's update moves no prediction)
    ys[1] = (xs[1][:, 0] < 0).long()  # step 1's labels are what the model predicts
    kept = {"hard": torch.ones(6, dtype=torch.bool)}

    def before(step: int) -> torch.Tensor:
        hard = kept["hard"].float()
        if keep_all and not bool(hard.any()):
            hard = torch.ones_like(hard)
        return hard / hard.sum()  # producer: hard example weights

    def loss_of(model: nn.Module, step: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(xs[step])
        kept["hard"] = logits.argmax(1) != ys[step]
        return (weights * F.cross_entropy(logits, ys[step], reduction="none")).sum(), logits

    return _loop(model, 4, before, loss_of)


# ---------------------------------------------------------------- an augmentation of the batch as the target
def _augmented_targets(eps: float) -> Scenario:
    """A contrastive-style regression whose target is an augmented view of the batch, a random scaling per feature
    then L2-normalised by the loop. Step 2's batch holds a blank sample: its view's norm is 0, and 0 / 0. The twin
    adds eps to the norm."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))
    xs = [torch.randn(5, 6) for _ in range(4)]
    xs[2][3] = 0.0
    scales = [torch.rand(6) + 0.5 for _ in range(4)]

    def before(step: int) -> torch.Tensor:
        view = xs[step] * scales[step]
        return view / (view.norm(dim=-1, keepdim=True) + eps)  # producer: augmented view

    def loss_of(model: nn.Module, step: int, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(xs[step])
        return F.mse_loss(F.normalize(out, dim=-1), target), out

    return _loop(model, 4, before, loss_of)


# ---------------------------------------------------------------- a target from a lookup table indexed by the batch
def _lookup_targets(smoothed: bool) -> Scenario:
    """Per-class inverse-frequency weights looked up by the batch's labels, ``1 / counts[y]``; the counts were taken on
    a split where class 3 never appears, and step 1's batch holds one: 1 / 0. The twin adds one to each count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    counts = torch.tensor([40.0, 25.0, 10.0, 0.0]) + (1.0 if smoothed else 0.0)
    xs = [torch.randn(6, 4) for _ in range(4)]
    ys = [torch.tensor([0, 1, 2, 0, 1, 2]) for _ in range(4)]
    ys[1] = torch.tensor([0, 1, 3, 0, 1, 2])

    def before(step: int) -> torch.Tensor:
        return 1.0 / counts[ys[step]]  # producer: class weights lookup

    def loss_of(model: nn.Module, step: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(xs[step])
        return (weights * F.cross_entropy(logits, ys[step], reduction="none")).mean(), logits

    return _loop(model, 4, before, loss_of)


# ---------------------------------------------------------------- what the loss code kept of the step, used in the next
def _mean_teacher_targets(eps: float) -> Scenario:
    """A mean teacher held as a plain weight, moved by the loss code before backward (``tw.mul_(0.5).add_(
    model.weight.detach(), alpha=0.5)``) and run by the loop on the next batch, its squared features normalised into
    targets. A blank sample of step 2 gives the bias-free teacher zero features: 0 / 0. The twin adds eps."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4, bias=False)
    tw = model.weight.detach().clone()
    xs = [torch.randn(5, 6) for _ in range(4)]
    xs[2][1] = 0.0

    def before(step: int) -> torch.Tensor:
        h = (xs[step] @ tw.t()).square()
        return h / (h.sum(-1, keepdim=True) + eps)  # producer: mean teacher targets

    def loss_of(model: nn.Module, step: int, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(xs[step])
        tw.mul_(0.5).add_(model.weight.detach(), alpha=0.5)  # (the loss code moves the teacher)
        return F.mse_loss(out.softmax(-1), target), out

    return _loop(model, 4, before, loss_of)


def _own_prediction_through_a_buffer(eps: float) -> Scenario:
    """The own-soft-targets row with the loss code writing the detached prediction into a slice of one of two
    preallocated buffers, in turn (``bufs[step % 2][:, :3] = out.detach().square()``), which the loop reads back
    through a new view the step after: the write marks the buffer, not only the slice it went through. A blank sample
    of step 1: step 2's sharpening is 0 / 0. The twin adds eps."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3, bias=False)
    xs = [torch.randn(5, 6) for _ in range(4)]
    xs[1][2] = 0.0
    bufs = [torch.ones(5, 8), torch.ones(5, 8)]

    def before(step: int) -> torch.Tensor:
        p = bufs[(step + 1) % 2][:, :3]
        return p / (p.sum(-1, keepdim=True) + eps)  # producer: own buffered targets

    def loss_of(model: nn.Module, step: int, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(xs[step])
        bufs[step % 2][:, :3] = out.detach().square()
        return F.mse_loss(out.softmax(-1), target), out

    return _loop(model, 4, before, loss_of)


def _pseudo_label_balance(eps: float) -> Scenario:
    """Class weights from the share of each class among the last step's pseudo-labels (``out.argmax(-1)``, kept by the
    loss code), ``1 / share`` looked up by the next batch's labels: a model that never predicts class 2 gives it share
    0, and step 1's batch holds one: 1 / 0. The twin adds eps to the share."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.bias.copy_(torch.tensor([0.0, 0.0, -50.0]))
    xs = [torch.randn(6, 4) for _ in range(4)]
    ys = [torch.tensor([0, 1, 0, 1, 0, 1]), torch.tensor([0, 1, 2, 1, 0, 1])] + [torch.tensor([0, 1, 2] * 2)] * 2
    kept = {"labels": torch.tensor([0, 1, 2, 0, 1, 2])}

    def before(step: int) -> torch.Tensor:
        share = torch.bincount(kept["labels"], minlength=3).float() / 6
        return 1.0 / (share + eps)  # producer: pseudo-label balance

    def loss_of(model: nn.Module, step: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(xs[step])
        kept["labels"] = logits.argmax(-1)
        return (weights[ys[step]] * F.cross_entropy(logits, ys[step], reduction="none")).mean(), logits

    return _loop(model, 4, before, loss_of)


def _running_loss_scale(eps: float) -> Scenario:
    """The loss normalised by the inverse of its own running mean, a tensor the loss code moves before backward
    (``m = 0.5 * m + 0.5 * loss.detach()``, no ``.item()``) and the loop inverts before the next call. Step 0's batch
    is fit exactly (blank inputs, zero targets, a bias-free model): the mean is 0, and step 1's inverse is 1 / 0."""
    torch.manual_seed(0)
    model = nn.Linear(6, 2, bias=False)
    xs, ys = [torch.randn(5, 6) for _ in range(4)], [torch.randn(5, 2) for _ in range(4)]
    xs[0].zero_()
    ys[0].zero_()
    kept = {"mean": torch.zeros(())}

    def before(step: int) -> torch.Tensor:
        return 1.0 / (kept["mean"] + eps) if step else torch.ones(())  # producer: running loss scale

    def loss_of(model: nn.Module, step: int, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(xs[step])
        raw = F.mse_loss(out, ys[step])
        kept["mean"] = 0.5 * kept["mean"] + 0.5 * raw.detach()
        return scale * raw, out

    return _loop(model, 4, before, loss_of)


CASES = [
    Case("ops_s28_own_detached_prediction_sharpened_over_a_zero_row", lambda: _own_soft_targets(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="own soft targets", cause="division-by-zero")),
    Case("ops_s28_own_detached_prediction_sharpened_eps_healthy", lambda: _own_soft_targets(1e-6), None),
    Case("ops_s28_unwatched_teacher_features_normalised_over_a_blank_sample", lambda: _teacher_targets(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="teacher weights", cause="division-by-zero")),
    Case("ops_s28_unwatched_teacher_features_normalised_eps_healthy", lambda: _teacher_targets(1e-6), None),
    Case("ops_s28_unwatched_teacher_features_through_a_buffer_over_a_blank_sample",
         lambda: _teacher_through_a_buffer(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="teacher buffer weights",
                cause="division-by-zero")),
    Case("ops_s28_unwatched_teacher_features_through_a_buffer_eps_healthy", lambda: _teacher_through_a_buffer(1e-6),
         None),
    Case("ops_s28_buffer_that_held_a_prediction_refilled_from_a_blank_annotation", lambda: _refilled_buffer(0.0),
         Expect("data", None, step=2, op="aten.div.Tensor", marker="refilled buffer targets",
                cause="division-by-zero")),
    Case("ops_s28_buffer_that_held_a_prediction_refilled_eps_healthy", lambda: _refilled_buffer(1e-6), None),
    Case("ops_s28_running_feature_scale_inverted_at_0", lambda: _running_feature_scale(0.0),
         Expect("forward", None, step=1, op="aten.reciprocal.default", marker="inverse running scale",
                cause="division-by-zero")),
    Case("ops_s28_running_feature_scale_eps_healthy", lambda: _running_feature_scale(1e-6), None),
    Case("ops_s28_hard_example_weights_of_no_mistake", lambda: _hard_example_weights(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="hard example weights",
                cause="division-by-zero")),
    Case("ops_s28_hard_example_weights_fall_back_healthy", lambda: _hard_example_weights(True), None),
    Case("ops_s28_augmented_view_normalised_over_a_blank_sample", lambda: _augmented_targets(0.0),
         Expect("data", None, step=2, op="aten.div.Tensor", marker="augmented view", cause="division-by-zero")),
    Case("ops_s28_augmented_view_normalised_eps_healthy", lambda: _augmented_targets(1e-6), None),
    Case("ops_s28_class_weights_looked_up_by_an_unseen_label", lambda: _lookup_targets(False),
         Expect("data", None, step=1, op="aten.reciprocal.default", marker="class weights lookup",
                cause="division-by-zero")),
    Case("ops_s28_class_weights_smoothed_healthy", lambda: _lookup_targets(True), None),
    Case("ops_s28_mean_teacher_moved_by_the_loss_code_over_a_blank_sample", lambda: _mean_teacher_targets(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="mean teacher targets",
                cause="division-by-zero")),
    Case("ops_s28_mean_teacher_moved_by_the_loss_code_eps_healthy", lambda: _mean_teacher_targets(1e-6), None),
    Case("ops_s28_pseudo_label_balance_of_a_class_never_predicted", lambda: _pseudo_label_balance(0.0),
         Expect("forward", None, step=1, op="aten.reciprocal.default", marker="pseudo-label balance",
                cause="division-by-zero")),
    Case("ops_s28_pseudo_label_balance_eps_healthy", lambda: _pseudo_label_balance(1e-6), None),
    Case("ops_s28_running_loss_mean_inverted_at_0", lambda: _running_loss_scale(0.0),
         Expect("forward", None, step=1, op="aten.reciprocal.default", marker="running loss scale",
                cause="division-by-zero")),
    Case("ops_s28_running_loss_mean_eps_healthy", lambda: _running_loss_scale(1e-6), None),
    Case("ops_s28_own_prediction_written_into_buffers_in_turn_by_the_loss_code_over_a_zero_row",
         lambda: _own_prediction_through_a_buffer(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="own buffered targets",
                cause="division-by-zero")),
    Case("ops_s28_own_prediction_written_into_buffers_in_turn_eps_healthy",
         lambda: _own_prediction_through_a_buffer(1e-6), None),
]
