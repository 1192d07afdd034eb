"""hunt20, the loops' shapes: runs that change mid-way, values no boundary sees, code around the model.

A recurrent state carried across steps, normalised by a norm of 0 while the step's loss stays finite; a
``torch.return_types`` structseq output; a module called with no argument; a float16 overflow that the next layer
clamps (ReLU6) and a child's -inf that its parent replaces (``nan_to_num``), which reach no boundary the tiered watch
reads every step (strict xfails in default and defer); Adam's eps set to 0 mid-run, an embedding unfrozen by
``add_param_group`` with eps=0, an activation swapped for a module the watch never saw; a loop under
``torch.autograd.detect_anomaly``; a focal loss written as an ``nn.Module`` criterion (outside the watched model,
and discovered as its own root); a DataLoader ``collate_fn`` standardising a last batch of 1; a sanity-check pass
before training; a gradient given to ``backward()`` (REINFORCE's ``log_probs.backward(-adv)``,
``torch.autograd.backward(tensors, grad_tensors)``) holding a NaN: data, at the backward line; SGD with
``weight_decay=5e4`` (for 5e-4), whose hint names the learning rate (strict xfail); a loss function compiled on its
own by ``torch.compile`` (the op's line: ops=True only; the others name the compiled function at its def).
Each with the healthy twin its users apply, silent and bit-identical in every mode.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef, TensorRole

CLAMPED_GAP = (
    "the tiered watch reads the model's boundaries (batch, outputs, loss, gradients, parameters) except on its "
    "per-module steps; a float16 Linear's +inf that the next layer clamps (ReLU6) reaches none of them, so the "
    "default and deferred watch stay silent where mode='full' and ops=True name the Linear")
REPLACED_GAP = (
    "the child's -inf reaches no boundary the tiered watch reads every step (its parent replaces it); the first "
    "per-module step (the watch's second) finds it, so the default and deferred watch report step 1, where it "
    "began at step 0 (mode='full' and ops=True: step 0)")
#: What the report says of a gradient the loop gave backward() (render/words/causes/without_op_rule.py).
GIVEN_SAYS = tuple((mode, "check the code that computed it") for mode in ("default", "defer", "full", "ops"))

# ---------------------------------------------------------------- shapes of the step: state, structseqs, no input
class StatefulCell(nn.Module):
    """A recurrent cell whose state is carried across training steps (truncated BPTT, detached), normalised to
    unit length; the step's output is the head of the cell, the normalised state is only read next step."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.rec = nn.Linear(6, 6, bias=False)
        self.head = nn.Linear(6, 1)
        self.eps = eps

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.inp(x) + self.rec(state))
        new_state = h / (h.norm(dim=1, keepdim=True) + self.eps)  # producer: carried state
        return self.head(h), new_state


def _stateful(eps: float) -> Scenario:
    """At step 2 every unit of the cell is dead (its input bias knocked far negative, put back at step 3): the
    state's norm is 0 and the carried state 0 / 0, while the step's own output and loss stay finite; the NaN would
    first reach a loss at step 3, through the state passed back in."""
    torch.manual_seed(0)
    model = StatefulCell(eps)
    with torch.no_grad():
        model.inp.bias.fill_(3.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs, ys = _batches(4, 4, steps=5), _batches(4, 1, steps=5)

    def run() -> list[torch.Tensor]:
        losses, state = [], torch.zeros(4, 6)
        for step in range(5):
            with torch.no_grad():
                model.inp.bias.fill_(-100.0 if step == 2 else 3.0)
            out, state = model(xs[step], state.detach())
            loss = F.mse_loss(out, ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


class TopScore(nn.Module):
    """Returns ``torch.max(log_scores, dim)`` itself: a ``torch.return_types.max`` (values, indices), a structseq
    that is neither a NamedTuple nor a plain tuple subclass of the user's."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.eps = eps

    def forward(self, x: torch.Tensor):
        h = F.relu(self.fc(x))
        return torch.log(h + self.eps).max(dim=1)  # producer: structseq


class TopScoreModel(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.top = TopScore(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.top(x).values[:, None]


def _structseq(eps: float) -> Scenario:
    """At step 2 every score is dead (the bias knocked far negative): log(0) is -inf in the structseq's values."""
    torch.manual_seed(0)
    model = TopScoreModel(eps)
    with torch.no_grad():
        model.top.fc.bias.fill_(3.0)
    xs, ys = _batches(4, 4), _batches(4, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.top.fc.bias.fill_(-100.0)
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


class Temperature(nn.Module):
    """A learned temperature called with no argument, ``self.temperature()``, as its reciprocal."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.ones(()))
        self.eps = eps

    def forward(self) -> torch.Tensor:
        return 1 / (self.t.abs() + self.eps)  # producer: no argument


class TempModel(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.temperature = Temperature(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.temperature()


def _no_argument(eps: float) -> Scenario:
    """At step 2 the temperature is 0 (a decay pulled it there): 1 / 0 in a call that had no input to check."""
    torch.manual_seed(0)
    model = TempModel(eps)
    xs, labels = _batches(4, 4), [torch.randint(0, 3, (4,)) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.temperature.t.zero_()
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.cross_entropy(out, labels[step]), lr=0.0)



# ---------------------------------------------------------------- a float16 overflow clamped by the next layer
def _clamped_overflow(overflows: bool) -> Scenario:
    """A float16 MobileNet-style block, Linear then ReLU6 (``.half()`` for memory): at step 2 a raw feature of
    6e4 (a sensor's unscaled reading) overflows the Linear to +inf, and ReLU6 clamps it to 6: the model's output,
    the loss and every gradient stay finite, only the Linear's own output is not. The twin scales the reading."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU6(), nn.Linear(4, 1)).half()
    xs, ys = [b.half() for b in _batches(4, 4)], [b.half() for b in _batches(4, 1)]
    with torch.no_grad():
        model[0].weight.fill_(0.5)
    xs[2][0] = 6e4 if overflows else 60.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out.float(), ys[step].float()),
                 lr=0.0)



# ---------------------------------------------------------------- the run changed mid-way: eps, groups, modules
def _changed_mid_run(change: str, eps: float) -> Scenario:
    """At step 3 the loop changes the run: change='eps' sets Adam's eps to ``eps`` in every group (a tweak to
    match a paper); change='group' unfreezes the embedding by ``add_param_group`` with that eps. Rows 4 and 5
    of the embedding are never looked up: with eps=0 their update is 0 / 0 at step 3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters() if change == "eps" else model[1].parameters(), lr=1e-3)
    tokens, ys = torch.tensor([0, 1, 2, 3]), _batches(4, 1, steps=5)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(5):
            if step == 3 and change == "eps":
                for group in opt.param_groups:
                    group["eps"] = eps
            if step == 3 and change == "group":
                opt.add_param_group({"params": model[0].parameters(), "eps": eps})
            loss = F.mse_loss(model(tokens), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: changed mid-run
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


class SwappedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.body(x)))


class LogActivation(nn.Module):
    """An activation tried in an ablation: ``log`` of its input, or ``log1p`` of its ReLU (the twin)."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.guarded = guarded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.guarded:
            return torch.log1p(F.relu(x))
        return torch.log(x)  # producer: swapped module


def _swapped_module(guarded: bool) -> Scenario:
    """At step 2 the loop swaps the model's activation for another (``model.act = LogActivation()``), a module
    the watch never saw when it began: log of a negative is NaN. Its name is the attribute's, ``act``."""
    torch.manual_seed(0)
    model = SwappedNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = _batches(8, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                model.act = LogActivation(guarded)
            loss = model(xs[step]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a child's -inf that its parent replaces
class CountLog(nn.Module):
    """The log of a count feature; the twin takes ``log1p``."""

    def __init__(self, shifted: bool) -> None:
        super().__init__()
        self.shifted = shifted

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        if self.shifted:
            return torch.log1p(counts)
        return torch.log(counts)  # producer: count log


class CountModel(nn.Module):
    """Replaces the child's -inf of a zero count by 0 (``nan_to_num``) before its head, in its own forward."""

    def __init__(self, shifted: bool) -> None:
        super().__init__()
        self.log = CountLog(shifted)
        self.head = nn.Linear(3, 1)

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.head(self.log(counts).nan_to_num(neginf=0.0))


def _replaced_by_the_parent(shifted: bool) -> Scenario:
    """Zero counts from step 0: the child's output holds -inf (an event: a module's output), which the parent
    turns into 0, so the model's output, the loss and every gradient stay finite."""
    torch.manual_seed(0)
    model = CountModel(shifted)
    counts = [torch.randint(0, 4, (8, 3)).float() for _ in range(4)]
    return _loop(model, lambda step: (counts[step],), lambda out, step: out.pow(2).mean())


# ---------------------------------------------------------------- a loop under torch.autograd.detect_anomaly
def _anomaly(eps: float) -> Scenario:
    """The loop already runs under ``torch.autograd.detect_anomaly(check_nan=True)`` (its users turned it on before
    reaching for nan_magic); at step 2 a blank sample puts a hand-written magnitude's sqrt at 0: its backward is
    inf, which anomaly mode would raise on as a RuntimeError. The twin adds an eps under the sqrt."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].bias.fill_(5.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = _batches(4, 4)
    xs[2][0] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        with torch.autograd.detect_anomaly(check_nan=True):
            for step in range(4):
                out = model(xs[step])
                loss = (torch.sqrt(out.pow(2) * xs[step][:, :1].abs() + eps)).mean()  # producer: anomaly
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)



# ---------------------------------------------------------------- a criterion module, a collate_fn, a sanity pass
class FocalLoss(nn.Module):
    """A focal loss written as an ``nn.Module`` (the criterion object), taking ``log(pt)`` without an eps."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(logits)
        pt = torch.where(target > 0, p, 1 - p)
        return (-(1 - pt) ** 2 * torch.log(pt + self.eps)).mean()  # producer: loss module


def _loss_module(eps: float, discover: bool) -> Scenario:
    """At step 2 a sample's logit saturates the sigmoid on the wrong side of its label: pt = 0 and log(0) = -inf.
    Watched as ``watch(model, opt)`` the criterion is code outside every watched module (None); watched by
    discovery (``%%nantrace`` with no targets) it is a module the cell uses: its own root, ``""``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    criterion = FocalLoss(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = _batches(4, 4)
    ys = [(torch.rand(4, 1) > 0.5).float() for _ in range(4)]
    xs[2][0] = 1e4
    ys[2][0] = 1.0 - (model(xs[2][:1]) > 0).float()

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = criterion(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario(() if discover else (model, opt), run)


def _collate(unbiased: bool) -> Scenario:
    """A DataLoader's ``collate_fn`` standardising each batch by its own std; 7 samples in batches of 3 leave a
    last batch of 1 at step 2, whose Bessel-corrected std is 0 / 0. The twin takes the std without correction."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(4), torch.randn(1)) for _ in range(7)]

    def collate(samples):
        x = torch.stack([s[0] for s in samples])
        y = torch.stack([s[1] for s in samples])
        std = x.std(0, unbiased=unbiased, keepdim=True)  # producer: collate
        return (x - x.mean(0, keepdim=True)) / (std + 1e-6), y

    loader = torch.utils.data.DataLoader(data, batch_size=3, collate_fn=collate)

    def run() -> list[torch.Tensor]:
        losses = []
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


class FeatureLog(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + self.eps)  # producer: feature log


def _sanity(eps: float) -> Scenario:
    """A sanity-check pass (two validation batches under ``no_grad``, as Lightning runs before training) inside
    the watch, then training: the step is still the optimizer steps completed (2), not the model calls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), FeatureLog(eps), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].bias.fill_(5.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs, ys = _batches(4, 4), _batches(4, 1)
    xs[2][0] = -100.0

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            model.eval()
            for x in xs[:2]:
                model(x)
            model.train()
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES = [
    Case("hunt20_carried_state_normalised_by_a_norm_of_0", lambda: _stateful(0.0),
         Expect("forward", "", "StatefulCell", step=2, op="aten.div.Tensor", marker="carried state")),
    Case("hunt20_carried_state_with_eps_healthy", lambda: _stateful(1e-6), None),
    Case("hunt20_structseq_output_log_of_dead_scores", lambda: _structseq(0.0),
         Expect("forward", "top", "TopScore", step=2, op="aten.log.default", marker="structseq")),
    Case("hunt20_structseq_output_log_with_eps_healthy", lambda: _structseq(1e-6), None),
    Case("hunt20_no_argument_call_reciprocal_of_a_temperature_0", lambda: _no_argument(0.0),
         Expect("forward", "temperature", "Temperature", step=2, op="aten.reciprocal.default", marker="no argument")),
    Case("hunt20_no_argument_call_with_eps_healthy", lambda: _no_argument(1e-6), None),
    Case("hunt20_float16_overflow_clamped_by_relu6", lambda: _clamped_overflow(True),
         Expect("forward", "0", "Linear", step=2, op="aten.addmm.default", kinds=frozenset({"+inf"})),
         modes=("full", "ops"), note=CLAMPED_GAP),
    Case("hunt20_float16_overflow_clamped_by_relu6_tiered", lambda: _clamped_overflow(True),
         Expect("forward", "0", "Linear", step=2, op="aten.addmm.default", kinds=frozenset({"+inf"})),
         modes=("default", "defer"), marks=(pytest.mark.xfail(strict=True, reason=CLAMPED_GAP),)),
    Case("hunt20_float16_reading_scaled_healthy", lambda: _clamped_overflow(False), None),
    Case("hunt20_adam_eps_set_to_0_mid_run", lambda: _changed_mid_run("eps", 0.0),
         Expect("optimizer", "0", "Embedding", step=3, op="aten.addcdiv_.default", marker="changed mid-run",
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"nan"}))),
    Case("hunt20_adam_eps_set_mid_run_healthy", lambda: _changed_mid_run("eps", 1e-6), None),
    Case("hunt20_embedding_unfrozen_by_add_param_group_with_eps_0", lambda: _changed_mid_run("group", 0.0),
         Expect("optimizer", "0", "Embedding", step=3, op="aten.addcdiv_.default", marker="changed mid-run",
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"nan"}))),
    Case("hunt20_embedding_unfrozen_by_add_param_group_healthy", lambda: _changed_mid_run("group", 1e-8), None),
    Case("hunt20_activation_swapped_mid_run_log_of_a_negative", lambda: _swapped_module(False),
         Expect("forward", "act", "LogActivation", step=2, op="aten.log.default", marker="swapped module")),
    Case("hunt20_activation_swapped_mid_run_log1p_healthy", lambda: _swapped_module(True), None),
    Case("hunt20_child_minus_inf_replaced_by_the_parent", lambda: _replaced_by_the_parent(False),
         Expect("forward", "log", "CountLog", step=0, op="aten.log.default", marker="count log"),
         modes=("full", "ops"), note=REPLACED_GAP),
    Case("hunt20_child_minus_inf_replaced_by_the_parent_tiered", lambda: _replaced_by_the_parent(False),
         Expect("forward", "log", "CountLog", step=0, op="aten.log.default", marker="count log"),
         modes=("default", "defer"), marks=(pytest.mark.xfail(strict=True, reason=REPLACED_GAP),)),
    Case("hunt20_child_log1p_of_counts_healthy", lambda: _replaced_by_the_parent(True), None),
    Case("hunt20_under_detect_anomaly_sqrt_backward_at_0", lambda: _anomaly(0.0),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="anomaly")),
    Case("hunt20_under_detect_anomaly_sqrt_with_eps_healthy", lambda: _anomaly(1e-8), None),
    Case("hunt20_criterion_module_log_of_pt_0", lambda: _loss_module(0.0, False),
         Expect("forward", None, step=2, op="aten.log.default", marker="loss module")),
    Case("hunt20_criterion_module_log_of_pt_0_discovered", lambda: _loss_module(0.0, True),
         Expect("forward", "", "FocalLoss", step=2, op="aten.log.default", marker="loss module")),
    Case("hunt20_criterion_module_with_eps_healthy", lambda: _loss_module(1e-6, False), None),
    Case("hunt20_criterion_module_with_eps_discovered_healthy", lambda: _loss_module(1e-6, True), None),
    Case("hunt20_collate_fn_std_of_a_last_batch_of_1", lambda: _collate(True),
         Expect("data", "", "Sequential", step=2, op="aten.std.correction", marker="collate")),
    Case("hunt20_collate_fn_std_uncorrected_healthy", lambda: _collate(False), None),
    Case("hunt20_after_a_sanity_check_pass_log_of_a_dead_feature", lambda: _sanity(0.0),
         Expect("forward", "2", "FeatureLog", step=2, op="aten.log.default", marker="feature log")),
    Case("hunt20_after_a_sanity_check_pass_healthy", lambda: _sanity(1e-6), None),
]


# ---------------------------------------------------------------- a gradient given to backward() holding a NaN
def _given_gradient(bad: bool, function: bool = False) -> Scenario:
    """REINFORCE written as ``log_probs.backward(-advantages)`` (a pipeline stage's ``out.backward(grad)`` alike):
    the gradient comes from outside the graph, and at step 2 an advantage is NaN (a return normalised by the std
    of an episode of one step). It is data, at the backward line; the twin's advantages are finite. function=True:
    the same by ``torch.autograd.backward(tensors, grad_tensors)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = _batches(4, 4)
    advantages = [torch.randn(4, 1) for _ in range(4)]
    if bad:
        advantages[2][1] = float("nan")

    def run() -> list[torch.Tensor]:
        outs = []
        for step in range(4):
            log_probs = model(xs[step])
            opt.zero_grad()
            if function:
                torch.autograd.backward([log_probs], [-advantages[step]])  # producer: given grad_tensors
            else:
                log_probs.backward(-advantages[step])  # producer: given gradient
            opt.step()
            outs.append(log_probs.detach())
        return outs

    return Scenario((model, opt), run)


CASES += [
    Case("hunt20_gradient_given_to_backward_holding_a_nan", lambda: _given_gradient(True),
         Expect("data", None, step=2, op=None, marker="given gradient", kinds=frozenset({"nan"}),
                tensor=TensorRef(TensorRole.INPUT, path="gradient given to backward()"), says=GIVEN_SAYS)),
    Case("hunt20_gradient_given_to_backward_finite_healthy", lambda: _given_gradient(False), None),
    Case("hunt20_grad_tensors_given_to_autograd_backward_holding_a_nan", lambda: _given_gradient(True, True),
         Expect("data", None, step=2, op=None, marker="given grad_tensors", kinds=frozenset({"nan"}),
                tensor=TensorRef(TensorRole.INPUT, path="gradient given to backward()"), says=GIVEN_SAYS)),
    Case("hunt20_grad_tensors_given_to_autograd_backward_healthy", lambda: _given_gradient(False, True), None),
]


# ---------------------------------------------------------------- a weight decay of 5e4 (for 5e-4)
def _weight_decay(decay: float) -> Scenario:
    """SGD with Nesterov momentum and ``weight_decay=5e4``, a typo for 5e-4: each step multiplies the weights by
    about 1 - lr * 5e4 = -4999, so the loss overflows in the forward of step 5 (the first non-finite value)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=decay)
    xs, ys = _batches(8, 4, steps=8), _batches(8, 1, steps=8)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(8):
            loss = F.mse_loss(model(xs[step]), ys[step])  # producer: weight decay
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES += [
    Case("hunt20_weight_decay_5e4_for_5e_4", lambda: _weight_decay(5e4),
         Expect("forward", None, step=5, op="aten.mse_loss.default", marker="weight decay")),
    Case("hunt20_weight_decay_5e4_for_5e_4_cause", lambda: _weight_decay(5e4),
         Expect("forward", None, step=5, op="aten.mse_loss.default", marker="weight decay",
                says=tuple((mode, "weight_decay") for mode in ("default", "defer", "full", "ops")))),
    Case("hunt20_weight_decay_5e_4_healthy", lambda: _weight_decay(5e-4), None),
]


# ---------------------------------------------------------------- a loss function compiled by torch.compile
def _compiled_loss(eps: float) -> Scenario:
    """A mean squared log error compiled on its own (``torch.compile(msle, backend="eager")``: dynamo's graph,
    run by the eager backend); at step 2 a target is 0 and log(0) is -inf. The recorder sees the op run by
    torch.fx's generated code (``<eval_with_key>``, no file the user can open): the tiered and per-module watch name
    the line of the graph node's stack trace (outside/generated.py; gaps23: the compiled function's ``def`` line
    before), ops=True (under which dynamo runs the function as written) the line itself."""
    torch._dynamo.reset()  # (each build compiles anew: past dynamo's recompile limit it would run eagerly)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = _batches(4, 4)
    ys = [torch.rand(4, 1) + 0.5 for _ in range(4)]
    ys[2][1] = 0.0

    def msle(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (torch.log(target + eps) - pred).pow(2).mean()  # producer: compiled loss

    loss_fn = torch.compile(msle, backend="eager")

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = loss_fn(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES += [
    Case("hunt20_compiled_loss_function_log_of_a_zero_target", lambda: _compiled_loss(0.0),
         Expect("forward", None, step=2, op="aten.log.default", marker="compiled loss")),
    Case("hunt20_compiled_loss_function_with_eps_healthy", lambda: _compiled_loss(1e-6), None),
]
