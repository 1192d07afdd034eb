"""Healthy loop shapes under the watch (calm_s33), every mode, each a variant earlier rounds did not run.

tests/calm_s30.py: the harness and what is compared. The rows: a frozen embedding unfrozen into a new Adam param
group with its own weight decay; an encoder frozen for the first steps by requires_grad_ and unfrozen (its Adam
state starts late); a rollback from an in-memory checkpoint (model.load_state_dict, optimizer.load_state_dict) after
a loss spike the loop detects, with the learning rate put back; a best-model deepcopy made inside the watch and
evaluated after it; an EMA teacher made by deepcopy inside the watch and called inside it; torch.save of the state
dicts and of the whole model to a buffer each step, one loaded back; early stops: a return from inside the watched
function mid-epoch after a backward without a step, a break out of two loops; clip_grad_value_(foreach=True) on the
body and clip_grad_norm_ on the head; a stateless SGD created each step; two optimizers over one model (Adam with
decay / no-decay groups stepping every other step, SGD on the head every step); LBFGS with strong Wolfe over a
loss with a -inf masked softmax; ReduceLROnPlateau in 'max' mode fed an accuracy; the model cast to float64 with a
new optimizer and back; a bfloat16 copy for evaluation; the user's activation-logging hook registered and removed
every step inside the watch; the watch entered around each epoch with a scheduler stepped outside it; the loop's
own exception (a Budget raised after the forward or the backward, an assert) in a step whose NaN batch the model
imputes, caught around the watch, and an evaluation loop over such batches left by next()'s StopIteration (each
was replaced by a NonFiniteError naming the handled batch: fixed in hot/kept/held_batch.py), and their other
side, an op's error the user wraps, still explained by the batch.
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
from calm_s30 import MODES, Row, check, data, mlp, sgd
from contract import MODE_OPTIONS
from torch import nn
from torch.nn import functional as F

import nan_magic

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)

NEG_INF = float("-inf")


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.enc, self.head = nn.Embedding(20, 6), nn.Sequential(nn.Linear(6, 16), nn.Tanh()), \
            nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(tokens)))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 20, (8,)), torch.randint(0, 3, (8,))


def embedding_unfrozen_into_new_group() -> Row:
    model = Tagger()
    model.emb.requires_grad_(False)
    opt = torch.optim.Adam([*model.enc.parameters(), *model.head.parameters()], lr=0.01)
    x, y = _tokens()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                if step == 2:
                    model.emb.requires_grad_(True)
                    opt.add_param_group({"params": model.emb.parameters(), "lr": 0.001, "weight_decay": 0.01})
                out.append(_train_step(model, opt, x, y))
        return out

    return Row((model, opt), (model, opt), run)


def encoder_frozen_then_unfrozen() -> Row:
    """The optimizer holds every parameter from the start; the encoder gets no gradient for two steps."""
    model = Tagger()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _tokens()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                model.enc.requires_grad_(step >= 2)
                out.append(_train_step(model, opt, x, y))
        return out

    return Row((model, opt), (model, opt), run)


def rollback_after_loss_spike() -> Row:
    """An in-memory checkpoint each good step; at step 2 the learning rate is set far too high, the loop sees the
    loss jump (finite) and rolls the model and the optimizer back, learning rate included."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out, best = [], None
        saved = None
        with watching():
            for step in range(5):
                if step == 2:
                    opt.param_groups[0]["lr"] = 30.0
                loss = _train_step(model, opt, x, y)
                with torch.no_grad():
                    after = F.cross_entropy(model(x), y)
                if saved is not None and after > 3 * best:
                    model.load_state_dict(saved[0])
                    opt.load_state_dict(saved[1])
                else:
                    best = after if best is None else torch.minimum(best, after)
                    saved = ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))
                out += [loss, after]
        assert opt.param_groups[0]["lr"] == 0.1
        return out

    return Row((model, opt), (model, opt), run)


def best_model_copy() -> Row:
    """copy.deepcopy(model) each time the validation loss improves, inside the watch; the copy is evaluated after."""
    model = mlp()
    opt = sgd(model)
    x, y = data()
    xv, yv = data()

    def run(watching) -> list[torch.Tensor]:
        out, best, best_loss = [], None, float("inf")
        with watching():
            for _ in range(4):
                out.append(_train_step(model, opt, x, y))
                with torch.no_grad():
                    val = F.cross_entropy(model(xv), yv).item()
                if val < best_loss:
                    best, best_loss = copy.deepcopy(model), val
        assert best is not None
        with torch.no_grad():
            out.append(best(xv))
        assert not best._forward_hooks and not best._forward_pre_hooks
        return out

    return Row((model, opt), (model, opt), run)


def ema_teacher_by_deepcopy() -> Row:
    """The teacher is copy.deepcopy(model) made at the first step inside the watch, updated by lerp_ and called
    inside the watch for a distillation term."""
    model = mlp()
    opt = sgd(model)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out, teacher = [], None
        with watching():
            for _ in range(4):
                if teacher is None:
                    teacher = copy.deepcopy(model).requires_grad_(False)
                logits = model(x)
                with torch.no_grad():
                    target = torch.softmax(teacher(x), -1)
                loss = F.cross_entropy(logits, y) + F.kl_div(torch.log_softmax(logits, -1), target,
                                                             reduction="batchmean")
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    for t, s in zip(teacher.parameters(), model.parameters(), strict=True):
                        t.lerp_(s, 0.1)
                out.append(loss.detach())
        assert teacher is not None
        out.append([p.detach().clone() for p in teacher.parameters()])
        return out

    return Row((model, opt), (model, opt), run)


def torch_save_in_the_loop() -> Row:
    """torch.save of {model, optimizer} state dicts and of the whole model to a buffer each step; the last state is
    loaded back into a fresh model after the watch."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(3):
                out.append(_train_step(model, opt, x, y))
                states, whole = io.BytesIO(), io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, states)
                torch.save(model, whole)
        states.seek(0)
        loaded = torch.load(states, weights_only=True)
        fresh = mlp()
        fresh.load_state_dict(loaded["model"])
        with torch.no_grad():
            out.append(fresh(x))
        whole.seek(0)
        with torch.no_grad():
            out.append(torch.load(whole, weights_only=False)(x))
        return out

    return Row((model, opt), (model, opt), run)


def early_return_mid_epoch() -> Row:
    """The watched function returns from the middle of an epoch once the loss is below a target, after a backward
    whose gradients it never steps with."""
    model = mlp()
    opt = sgd(model)
    batches = [data() for _ in range(4)]

    def run(watching) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []

        def train() -> int:
            with watching():
                for epoch in range(3):
                    for i, (x, y) in enumerate(batches):
                        loss = F.cross_entropy(model(x), y)
                        opt.zero_grad()
                        loss.backward()
                        out.append(loss.detach())
                        if epoch == 1 and i == 2:
                            return epoch
                        opt.step()
            return -1

        assert train() == 1
        out.append([p.grad.clone() for p in model.parameters()])
        return out

    return Row((model, opt), (model, opt), run)


def break_out_of_two_loops() -> Row:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = [data() for _ in range(3)]

    def run(watching) -> list[torch.Tensor]:
        out, stop = [], False
        with watching():
            for _ in range(3):
                for x, y in batches:
                    out.append(_train_step(model, opt, x, y))
                    if len(out) == 5:
                        stop = True
                        break
                if stop:
                    break
            out.append(F.cross_entropy(model(batches[0][0]), batches[0][1]).detach())
        return out

    return Row((model, opt), (model, opt), run)


def clip_value_foreach_and_norm_on_head() -> Row:
    model = mlp()
    opt = sgd(model)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_value_(model[0].parameters(), 0.01, foreach=True)
                out.append(torch.nn.utils.clip_grad_norm_(model[2].parameters(), 0.5))
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def stateless_sgd_each_step() -> Row:
    """torch.optim.SGD(model.parameters(), lr=...) built in the loop at every step (a schedule by hand)."""
    model = mlp()
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                out.append(_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1 / (1 + step)), x, y))
        return out

    return Row((model,), (model,), run)


def two_optimizers_split_groups() -> Row:
    """AdamW over the body with decay and no-decay groups, stepping every other step (accumulating between); SGD
    over the head stepping and zeroing every step."""
    model = mlp()
    body, head = model[0], model[2]
    opt_body = torch.optim.AdamW([{"params": [body.weight], "weight_decay": 0.1},
                                  {"params": [body.bias], "weight_decay": 0.0}], lr=0.01)
    opt_head = torch.optim.SGD(head.parameters(), lr=0.05)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt_head.step()
                opt_head.zero_grad()
                if step % 2 == 1:
                    opt_body.step()
                    opt_body.zero_grad()
                out.append(loss.detach())
        return out

    return Row((model, opt_body, opt_head), (model, opt_body, opt_head), run)


def lbfgs_strong_wolfe_masked_softmax() -> Row:
    """LBFGS(line_search_fn='strong_wolfe') whose closure's loss takes a softmax over classes masked with -inf."""
    model = mlp(6, 4)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3, line_search_fn="strong_wolfe")
    x, y = data(classes=3)
    banned = torch.tensor([False, False, False, True])

    def run(watching) -> list[torch.Tensor]:
        out = []

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x).masked_fill(banned, NEG_INF), y)
            loss.backward()
            return loss

        with watching():
            for _ in range(2):
                out.append(opt.step(closure).detach())
        return out

    return Row((model, opt), (model, opt), run)


def plateau_on_accuracy() -> Row:
    """ReduceLROnPlateau(mode='max', patience=0) fed the accuracy each epoch; the learning rate falls."""
    model = mlp()
    opt = sgd(model)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0)
    x, y = data()

    def run(watching) -> list:
        out = []
        with watching():
            for _ in range(4):
                out.append(_train_step(model, opt, x, y))
                with torch.no_grad():
                    acc = (model(x).argmax(-1) == y).float().mean().item()
                sched.step(1.0 if not out[:-1] else acc * 0)  # (the accuracy read, then a plateau on purpose)
                out.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[0]["lr"] < 0.05
        return out

    return Row((model, opt), (model, opt), run)


def float64_and_back_with_new_optimizers() -> Row:
    model = mlp()
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        with watching():
            for step in range(4):
                if step == 1:
                    model.double()
                    opt = torch.optim.Adam(model.parameters(), lr=0.01)
                if step == 3:
                    model.float()
                    opt = torch.optim.Adam(model.parameters(), lr=0.01)
                xs = x.double() if step in (1, 2) else x
                out.append(_train_step(model, opt, xs, y))
        return out

    return Row((model,), (model,), run)


def bfloat16_copy_for_eval() -> Row:
    model = mlp()
    opt = sgd(model)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                out.append(_train_step(model, opt, x, y))
                with torch.no_grad():
                    out.append(copy.deepcopy(model).to(torch.bfloat16)(x.bfloat16()).float())
        return out

    return Row((model, opt), (model, opt), run)


def activation_logging_hook_each_step() -> Row:
    """The user registers a forward hook that records the hidden activation's statistics, and removes it, every
    step inside the watch."""
    model = mlp()
    opt = sgd(model)
    x, y = data()

    def run(watching) -> list[torch.Tensor]:
        out: list = []
        with watching():
            for _ in range(3):
                handle = model[1].register_forward_hook(lambda m, a, o: out.append(o.detach().std()))
                out.append(_train_step(model, opt, x, y))
                handle.remove()
        return out

    return Row((model, opt), (model, opt), run)


def watch_per_epoch_scheduler_outside() -> Row:
    """The watch is entered around each epoch's batches; the StepLR and a validation pass run between watches."""
    model = mlp()
    opt = sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    batches = [data() for _ in range(2)]

    def run(watching) -> list[torch.Tensor]:
        out = []
        for _ in range(3):
            with watching():
                for x, y in batches:
                    out.append(_train_step(model, opt, x, y))
            sched.step()
            with torch.no_grad():
                out.append(model(batches[0][0]))
        return out

    return Row((model, opt), (model, opt), run)


class Imputing(nn.Module):
    """A tabular model that imputes its NaN-coded missing values (a learned fill and a missing flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.fill = nn.Parameter(torch.zeros(6))
        self.net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        missing = x.isnan()
        return self.net(torch.cat([torch.where(missing, self.fill, x), missing.float()], -1))


def _missing() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data()
    x[torch.rand(8, 6) < 0.2] = float("nan")
    return x, y


class Budget(Exception):
    """The user's own early stop, raised where the time budget is spent and caught around the watch."""


def own_exception_mid_step(where: str) -> Row:
    """Batches with missing values the model imputes (a held NaN batch, handled); at step 1 the loop raises its own
    Budget after the forward (or after the backward, or by an assert) and catches it outside the watch."""
    model = Imputing()
    opt = sgd(model)
    x, y = _missing()

    def run(watching) -> list[torch.Tensor]:
        out = []
        try:
            with watching():
                for step in range(3):
                    loss = F.cross_entropy(model(x), y)
                    out.append(loss.detach())
                    if step == 1 and where == "forward":
                        raise Budget("time budget spent")
                    opt.zero_grad()
                    loss.backward()
                    if step == 1 and where == "backward":
                        raise Budget("time budget spent")
                    assert step < 1 or where != "assert", "stop after the second backward"
                    opt.step()
        except (Budget, AssertionError) as stopped:
            out.append(torch.tensor(len(str(stopped))))
        return out

    return Row((model, opt), (model, opt), run)


def evaluation_ended_by_stop_iteration(source: str) -> Row:
    """An evaluation loop under no_grad, ``while True: model(next(batches))``, over batches with missing values the
    model imputes, left by the StopIteration of next() past the last one (from a list's iterator or a DataLoader's),
    caught around the watch."""
    model = Imputing().eval()
    x = torch.cat([_missing()[0] for _ in range(3)])
    batches = list(x.split(8)) if source == "list" else torch.utils.data.DataLoader(x, batch_size=8)

    def run(watching) -> list[torch.Tensor]:
        out = []
        it = iter(batches)
        try:
            with watching(), torch.no_grad():
                while True:
                    out.append(model(next(it)))
        except StopIteration:
            out.append(torch.tensor(len(out)))
        return out

    return Row((model,), (model,), run)


ROWS = {
    "embedding_unfrozen_into_new_group": embedding_unfrozen_into_new_group,
    "encoder_frozen_then_unfrozen": encoder_frozen_then_unfrozen,
    "rollback_after_loss_spike": rollback_after_loss_spike,
    "best_model_copy": best_model_copy,
    "ema_teacher_by_deepcopy": ema_teacher_by_deepcopy,
    "torch_save_in_the_loop": torch_save_in_the_loop,
    "early_return_mid_epoch": early_return_mid_epoch,
    "break_out_of_two_loops": break_out_of_two_loops,
    "clip_value_foreach_and_norm_on_head": clip_value_foreach_and_norm_on_head,
    "stateless_sgd_each_step": stateless_sgd_each_step,
    "two_optimizers_split_groups": two_optimizers_split_groups,
    "lbfgs_strong_wolfe_masked_softmax": lbfgs_strong_wolfe_masked_softmax,
    "plateau_on_accuracy": plateau_on_accuracy,
    "float64_and_back_with_new_optimizers": float64_and_back_with_new_optimizers,
    "bfloat16_copy_for_eval": bfloat16_copy_for_eval,
    "activation_logging_hook_each_step": activation_logging_hook_each_step,
    "watch_per_epoch_scheduler_outside": watch_per_epoch_scheduler_outside,
    **{f"own_exception_after_{where}_with_a_handled_nan_batch": (lambda where=where: own_exception_mid_step(where))
       for where in ("forward", "backward", "assert")},
    **{f"evaluation_ended_by_stop_iteration_{source}": functools.partial(evaluation_ended_by_stop_iteration, source)
       for source in ("list", "loader")},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_loops_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)


def test_the_rows_really_do_what_they_say() -> None:
    """The rollback row really rolls back (the spike is seen), the LBFGS row's logits really hold -inf, the early
    return leaves gradients, and the unwatched loops end with finite parameters."""
    torch.manual_seed(0)
    row = rollback_after_loss_spike()
    out = row.run(__import__("contextlib").nullcontext)
    spiked = [float(a) for a in out[1::2]]
    assert max(spiked) > 3 * min(spiked[:2])
    torch.manual_seed(0)
    with _MaskedLogits() as seen:
        out = lbfgs_strong_wolfe_masked_softmax().run(__import__("contextlib").nullcontext)
    assert seen.neginf and all(torch.isfinite(loss) for loss in out)  # -inf logits, finite losses
    torch.manual_seed(0)
    grads = early_return_mid_epoch().run(__import__("contextlib").nullcontext)[-1]
    assert any(bool(g.abs().sum() > 0) for g in grads)  # the backward's gradients, never stepped with, are there
    for name, build in ROWS.items():
        torch.manual_seed(0)
        row = build()
        row.run(__import__("contextlib").nullcontext)
        for held in row.held:
            if isinstance(held, nn.Module):
                assert all(torch.isfinite(p).all() for p in held.parameters()), name


class _MaskedLogits(torch.overrides.TorchFunctionMode):
    """Whether a ``masked_fill`` made a tensor holding -inf while it was on (the LBFGS row's logits)."""

    neginf = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.masked_fill, torch.masked_fill) and isinstance(out, torch.Tensor):
            self.neginf = self.neginf or bool(torch.isneginf(out).any())
        return out


class SamplingError(Exception):
    pass


@pytest.mark.parametrize("mode", MODES)
def test_an_ops_error_the_user_wraps_in_their_own_is_still_explained_by_the_held_batch(mode: str) -> None:
    """The other side of the own-exception rows: torch.multinomial raises on the batch's NaN in the loop's code and
    the loop raises its own SamplingError from it; the held batch explains it (a data report), as with the bare
    RuntimeError."""
    for wrap in (False, True):
        torch.manual_seed(0)
        model = Imputing()
        x, y = _missing()
        with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, **MODE_OPTIONS[mode]):
            F.cross_entropy(model(x), y)
            try:
                torch.multinomial(x.abs().sum(1), 2)
            except RuntimeError as error:
                if wrap:
                    raise SamplingError("could not sample") from error
                raise
        report = caught.value.report
        assert (report.phase, report.module, report.step, report.nan) == ("data", "", 0, int(x.isnan().sum())), wrap
