"""Healthy loop shapes under the watch (calm_s31), every mode: clip_grad_value_ after a CPU GradScaler's unscale_
under bfloat16 autocast and over a model with frozen layers, the user's hooks removed mid-loop, accumulation
inside a no_sync-like context with loss / accum_steps, layers frozen then unfrozen into a new param group and
frozen in turn each step, a head added to the model mid-watch, LBFGS with strong Wolfe on a head, an optimizer
rebuilt from a state_dict mid-watch (resume), the model moved to float64 and back mid-watch, a generator pipeline
read by next(), a metric by .cpu().numpy() under no_grad, tqdm around the loop, torch.manual_seed each step, a
fork_rng evaluation, WGAN critic weights clipped in place by p.data.clamp_, the user's optimizer step hooks, a
shape RuntimeError caught and the batch retried, the user's global module hooks, saved-tensor hooks and always_call
hooks, multinomial sampling in the forward, a saliency map by autograd.grad of the input, clip_grad_norm_ with
error_if_nonfinite then clip_grad_value_; and the two rows this round fixed (a feature extractor's StopForward, a
root full backward hook's warning).
"""

from __future__ import annotations

import contextlib
import io
import itertools

import numpy as np
import pytest
import torch
from calm_s30 import MODES, Row, check, steps
from torch import nn
from torch.nn import functional as F
from tqdm.auto import tqdm

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)


def _mlp(d_in: int = 6, d_out: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out))


def _data(n: int = 8, d_in: int = 6, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, d_in), torch.randint(0, classes, (n,))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


# -- clipping by value -------------------------------------------------------------------------------------


def scaler_bf16_clip_value(accum: int) -> Row:
    """bfloat16 autocast on the CPU, GradScaler("cpu"), unscale_ then clip_grad_value_; ``accum`` micro-batches."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    batches = [_data() for _ in range(accum)]

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                for x, y in batches:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = F.cross_entropy(model(x), y) / accum
                    scaler.scale(loss).backward()
                    out.append(loss.detach().float())
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                out.append(torch.tensor(scaler.get_scale()))
        return out

    return Row((model, opt), (model, opt, scaler), run)


def clip_value_with_frozen_layers() -> Row:
    """Some grads are None (a frozen embedding-like first layer): clip_grad_value_ skips them, foreach off."""
    model = _mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01, foreach=False)
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


# -- the user's hooks, removed mid-loop --------------------------------------------------------------------


def hooks_removed_mid_loop() -> Row:
    """An activation-capture forward hook removed after step 1, a gradient-logging full backward hook after step 0,
    a tensor hook on the output that the loop registers each step."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()
    captured: list[torch.Tensor] = []

    def run(watching) -> list[torch.Tensor]:
        fwd = model[1].register_forward_hook(lambda m, a, o: captured.append(o.detach().mean()))
        bwd = model[2].register_full_backward_hook(lambda m, gi, go: captured.append(go[0].norm()))
        out = []
        with watching():
            for step in range(4):
                logits = model(x)
                logits.register_hook(lambda g: g * 1.0)
                loss = F.cross_entropy(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
                if step == 0:
                    bwd.remove()
                if step == 1:
                    fwd.remove()
        return [out, captured]

    return Row((model, opt), (model, opt), run)


# -- accumulation ------------------------------------------------------------------------------------------


class Replicated(nn.Module):
    """A DDP-like wrapper without a process group: ``no_sync()`` marks the micro-batches whose grads stay local."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True

    @contextlib.contextmanager
    def no_sync(self):
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def accumulation_no_sync() -> Row:
    model = Replicated(_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    accum_steps = 3
    batches = [_data(4) for _ in range(6)]

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for i, (x, y) in enumerate(batches):
                last = (i + 1) % accum_steps == 0
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = F.cross_entropy(model(x), y) / accum_steps
                    loss.backward()
                out.append(loss.detach())
                if last:
                    opt.step()
                    opt.zero_grad()
        return out

    return Row((model, opt), (model, opt), run)


# -- freezing and unfreezing -------------------------------------------------------------------------------


def unfreeze_into_new_group() -> Row:
    """Linear probing for two steps (the backbone frozen, not in the optimizer), then the backbone unfrozen and
    added as a param group at a lower lr."""
    backbone = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
    model = nn.Sequential(backbone, nn.Linear(16, 3))
    backbone.requires_grad_(False)
    opt = torch.optim.Adam(model[1].parameters(), lr=0.01)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(5):
                if step == 2:
                    backbone.requires_grad_(True)
                    opt.add_param_group({"params": backbone.parameters(), "lr": 1e-3})
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def alternate_frozen_halves() -> Row:
    """Block-coordinate training: each step one half of the model is frozen by requires_grad_ toggles, one
    optimizer over all of it (the frozen half's grads are None and skipped)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    x, y = _data()

    def loss_of(step: int) -> torch.Tensor:
        model[0].requires_grad_(step % 2 == 0)
        model[2].requires_grad_(step % 2 == 1)
        return F.cross_entropy(model(x), y)

    def run(watching) -> list[torch.Tensor]:
        out = steps(model, opt, loss_of, 4)(watching)
        model.requires_grad_(True)
        return out

    return Row((model, opt), (model, opt), run)


def head_added_mid_watch() -> Row:
    """Continual learning: at step 2 a second head is added to the model (add_module) and to the optimizer."""

    class MultiHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
            self.heads = nn.ModuleList([nn.Linear(16, 3)])

        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            h = self.body(x)
            return [head(h) for head in self.heads]

    model = MultiHead()
    opt = _sgd(model)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                if step == 2:
                    model.heads.append(nn.Linear(16, 3))
                    opt.add_param_group({"params": model.heads[-1].parameters()})
                loss = sum(F.cross_entropy(logits, y) for logits in model(x))
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


# -- LBFGS and optimizer state -----------------------------------------------------------------------------


def lbfgs_head_only() -> Row:
    """A frozen feature extractor, LBFGS(line_search_fn="strong_wolfe") over the head with an L2 penalty."""
    model = _mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.LBFGS(model[2].parameters(), lr=1, max_iter=5, history_size=3, line_search_fn="strong_wolfe")
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y) + 1e-2 * model[2].weight.pow(2).sum()
            loss.backward()
            return loss

        with watching():
            for _ in range(3):
                out.append(opt.step(closure).detach())
        return out

    return Row((model, opt), (model, opt), run)


def resume_optimizer_from_state_dict() -> Row:
    """At step 2 the loop 'resumes': a new Adam is made and loads the state saved at step 1 (torch.save to bytes,
    torch.load), and training goes on with it."""
    model = _mlp()
    held = [torch.optim.Adam(model.parameters(), lr=0.01)]
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        opt, saved, out = held[0], io.BytesIO(), []
        with watching():
            for step in range(4):
                if step == 1:
                    torch.save(opt.state_dict(), saved)
                if step == 2:
                    saved.seek(0)
                    opt = torch.optim.Adam(model.parameters(), lr=0.01)
                    opt.load_state_dict(torch.load(saved, weights_only=True))
                    held.append(opt)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return [out, [v for s in opt.state.values() for v in s.values()]]

    return Row((model, held[0]), (model, held[0]), run)


def float64_mid_watch() -> Row:
    """For two steps the loop trains in float64 (model.to(torch.float64), the batch too), then back to float32."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(5):
                dtype = torch.float64 if step in (1, 2) else torch.float32
                model.to(dtype)
                loss = F.cross_entropy(model(x.to(dtype)), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach().float())
        return out

    return Row((model, opt), (model, opt), run)


# -- data, metrics, progress, seeds ------------------------------------------------------------------------


def generator_pipeline() -> Row:
    """An infinite generator of augmented batches (yield), read by next() inside the loop, plus a finite one
    exhausted mid-loop (StopIteration caught: a new epoch)."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data(16)

    def augmented():
        for i in itertools.count():
            idx = torch.arange(4) + (4 * i) % 16
            yield x[idx] + 0.01 * torch.randn(4, 6), y[idx]

    def run(watching) -> list[torch.Tensor]:
        stream, epoch, out = augmented(), iter(zip(x.split(8), y.split(8))), []
        with watching():
            for _ in range(4):
                xb, yb = next(stream)
                try:
                    xe, ye = next(epoch)
                except StopIteration:
                    epoch = iter(zip(x.split(8), y.split(8)))
                    xe, ye = next(epoch)
                loss = F.cross_entropy(model(xb), yb) + F.cross_entropy(model(xe), ye)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def numpy_metric_each_step() -> Row:
    """Accuracy and a confusion matrix by numpy from .cpu().numpy() under no_grad, in eval mode, each step."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 3))
    opt = _sgd(model)
    x, y = _data()

    def run(watching) -> list:
        out = []
        with watching():
            for _ in range(3):
                model.train()
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    pred = model(x).argmax(-1).cpu().numpy()
                truth = y.cpu().numpy()
                confusion = np.zeros((3, 3), dtype=np.int64)
                np.add.at(confusion, (truth, pred), 1)
                out += [loss.detach(), float((pred == truth).mean()), torch.from_numpy(confusion)]
        model.train()
        return out

    return Row((model, opt), (model, opt), run)


def tqdm_progress() -> Row:
    """tqdm around the loop, the loss shown by set_postfix (a .item() each step), written to a buffer."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            bar = tqdm(range(4), file=io.StringIO(), mininterval=0)
            for _ in bar:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                bar.set_postfix(loss=f"{loss.item():.4f}")
                out.append(loss.detach())
            bar.close()
        return out

    return Row((model, opt), (model, opt), run)


def seeded_each_step() -> Row:
    """torch.manual_seed(step) at the top of each step (reproducible dropout masks), plus an evaluation under
    torch.random.fork_rng that must not move the training RNG."""
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = _sgd(model)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                torch.manual_seed(1000 + step)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.random.fork_rng(devices=[]), torch.no_grad():
                    out.append(model(torch.randn(4, 6)).sum())
                out += [loss.detach(), torch.rand(1)]
        return out

    return Row((model, opt), (model, opt), run)


# -- WGAN and optimizer hooks ------------------------------------------------------------------------------


def wgan_weight_clipping() -> Row:
    """WGAN (Arjovsky et al.): five critic steps per generator step, RMSprop, the critic's weights clipped in
    place by p.data.clamp_ after each critic step; the generator's step freezes the critic."""
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
    critic = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.RMSprop(gen.parameters(), lr=5e-4)
    opt_c = torch.optim.RMSprop(critic.parameters(), lr=5e-4)
    real = torch.randn(32, 6) * 0.5 + 1.0

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(2):
                for i in range(5):
                    fake = gen(torch.randn(8, 4)).detach()
                    loss_c = critic(fake).mean() - critic(real[8 * (i % 4):8 * (i % 4) + 8]).mean()
                    opt_c.zero_grad()
                    loss_c.backward()
                    opt_c.step()
                    for p in critic.parameters():
                        p.data.clamp_(-0.01, 0.01)
                    out.append(loss_c.detach())
                critic.requires_grad_(False)
                loss_g = -critic(gen(torch.randn(8, 4))).mean()
                opt_g.zero_grad()
                loss_g.backward()
                opt_g.step()
                critic.requires_grad_(True)
                out.append(loss_g.detach())
        return out

    return Row((gen, critic, opt_g, opt_c), (gen, critic, opt_g, opt_c), run)


def optimizer_step_hooks() -> Row:
    """The user's own optimizer hooks: a step pre-hook that logs the grad norm, a post-hook that clamps a
    positive scale parameter in place, both removed before the last step."""
    model = _mlp()
    scale = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([*model.parameters(), scale], lr=0.05)
    x, y = _data()
    norms: list[torch.Tensor] = []

    def post(optimizer, args, kwargs) -> None:
        with torch.no_grad():
            scale.clamp_(min=0.1)

    def run(watching) -> list[torch.Tensor]:
        pre_h = opt.register_step_pre_hook(
            lambda o, a, k: norms.append(torch.stack([p.grad.norm() for p in model.parameters()]).sum()))
        post_h = opt.register_step_post_hook(post)
        out = []
        with watching():
            for step in range(4):
                if step == 3:
                    pre_h.remove()
                    post_h.remove()
                loss = F.cross_entropy(model(x) * scale, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return [out, norms, scale.detach()]

    return Row((model, opt), (model, opt), run)


# -- the user's exceptions, global hooks, saved-tensor hooks, sampling, input gradients -----------------------


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.net(x)


def shape_error_fallback() -> Row:
    """The loop tries each batch as it comes; a batch with a feature missing raises a shape RuntimeError inside the
    model, caught: padded and called again. The model counts its calls."""
    model = Counting()
    opt = _sgd(model)
    xs = [torch.randn(8, 6), torch.randn(8, 5), torch.randn(8, 6)]
    y = torch.randint(0, 3, (8,))

    def run(watching) -> list:
        out = []
        with watching():
            for x in xs:
                try:
                    logits = model(x)
                except RuntimeError:
                    logits = model(F.pad(x, (0, 6 - x.shape[1])))
                loss = F.cross_entropy(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return [out, model.calls]

    return Row((model, opt), (model, opt), run)


def global_module_hooks() -> Row:
    """The user's global hooks on every module (register_module_forward_hook logging shapes, a global full backward
    hook and pre-hook), removed after the loop: the watch's own global hooks step aside beside them."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()
    widths: list[int] = []
    module = nn.modules.module

    def run(watching) -> list:
        handles = [
            module.register_module_forward_hook(
                lambda m, a, o: widths.append(o.shape[-1]) if isinstance(o, torch.Tensor) else None),
            module.register_module_full_backward_hook(lambda m, gi, go: None),
            module.register_module_forward_pre_hook(lambda m, a: None),
        ]
        try:
            return [steps(model, opt, lambda s: F.cross_entropy(model(x), y))(watching), widths]
        finally:
            for handle in handles:
                handle.remove()

    return Row((model, opt), (model, opt), run)


def users_saved_tensor_hooks() -> Row:
    """The forward under the user's saved_tensors_hooks (pack by a copy, unpack as is)."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()

    def loss_of(step: int) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            return F.cross_entropy(model(x), y)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def always_call_hooks() -> Row:
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()
    log: list[int] = []
    model.register_forward_hook(lambda m, a, o: log.append(1), always_call=True)
    model[0].register_forward_hook(lambda m, a, o: log.append(2), always_call=True, prepend=True)
    inner = steps(model, opt, lambda s: F.cross_entropy(model(x), y))
    return Row((model, opt), (model, opt), lambda watching: [inner(watching), log])


class Sampling(nn.Module):
    """A policy that samples its action by torch.multinomial inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp(6, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.net(x).softmax(-1)
        action = torch.multinomial(p, 1).squeeze(-1)
        return p.gather(1, action[:, None]).log().squeeze(-1), action


def multinomial_in_the_forward() -> Row:
    model = Sampling()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, advantage = torch.randn(8, 6), torch.randn(8)
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: -(model(x)[0] * advantage).mean()))


def saliency_between_steps() -> Row:
    """After each step, a saliency map: autograd.grad of the true class's score by the input (not by a parameter)."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                inp = x.clone().requires_grad_()
                (saliency,) = torch.autograd.grad(model(inp).gather(1, y[:, None]).sum(), inp)
                out += [loss.detach(), saliency.abs().amax(1)]
        return out

    return Row((model, opt), (model, opt), run)


def clip_norm_then_value() -> Row:
    """clip_grad_norm_(error_if_nonfinite=True, foreach=True), its total norm kept, then clip_grad_value_."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                out.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, error_if_nonfinite=True,
                                                          foreach=True))
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


# -- what the engine got wrong before this round (each row failed without its fix) ------------------------------


class StopForward(Exception):
    """A feature extractor's own signal: the forward has gone as far as needed."""


def feature_extractor_stops_the_forward() -> Row:
    """Between training steps the loop takes the hidden features by a forward hook that raises StopForward (the
    rest of the model is not run), caught by the loop. Was: a forward that raised was replayed to look for a NaN
    before the exception, the user's hook firing twice (two features appended a step); now only an error a bad
    value can cause is replayed (nan_magic/localize/raised.py)."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()
    features: list[torch.Tensor] = []

    def grab(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        features.append(out.detach().clone())
        raise StopForward

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
                handle = model[1].register_forward_hook(grab)
                try:
                    model(x)
                except StopForward:
                    pass
                finally:
                    handle.remove()
        return [out, features]

    return Row((model, opt), (model, opt), run)


def root_backward_hook_without_input_grads() -> Row:
    """The user's full backward hook on the model itself, whose input (the batch) needs no gradient: torch warns
    that the hook fires with respect to the outputs, with a stacklevel counted for its own frames. Was: the warning
    named nan_magic/patches/backward.py (one frame of ours more than torch's Tensor.backward); now the user's
    loss.backward() line (the patched Tensor.backward is installed without a dispatch frame: registry.SelfGated)."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()
    norms: list[torch.Tensor] = []
    model.register_full_backward_hook(lambda m, gi, go: norms.append(go[0].norm()))
    model.register_forward_hook(lambda m, a, o: o / 1.5)  # and a temperature on the model's output
    inner = steps(model, opt, lambda s: F.cross_entropy(model(x), y))
    return Row((model, opt), (model, opt), lambda watching: [inner(watching), norms])


ROWS = {
    "feature_extractor_hook_raises_stop_forward": feature_extractor_stops_the_forward,
    "root_full_backward_hook_no_input_grads": root_backward_hook_without_input_grads,
    "shape_runtime_error_caught_and_retried": shape_error_fallback,
    "users_global_module_hooks": global_module_hooks,
    "users_saved_tensors_hooks": users_saved_tensor_hooks,
    "users_always_call_forward_hooks": always_call_hooks,
    "multinomial_sampling_in_the_forward": multinomial_in_the_forward,
    "saliency_input_grad_between_steps": saliency_between_steps,
    "clip_grad_norm_error_if_nonfinite_then_value": clip_norm_then_value,
    "scaler_bf16_autocast_clip_grad_value": lambda: scaler_bf16_clip_value(1),
    "scaler_bf16_autocast_accumulate_clip_value": lambda: scaler_bf16_clip_value(2),
    "clip_grad_value_frozen_layer_none_grads": clip_value_with_frozen_layers,
    "user_hooks_removed_mid_loop": hooks_removed_mid_loop,
    "accumulation_no_sync_context": accumulation_no_sync,
    "unfreeze_backbone_add_param_group": unfreeze_into_new_group,
    "alternate_frozen_halves_each_step": alternate_frozen_halves,
    "head_added_to_model_mid_watch": head_added_mid_watch,
    "lbfgs_strong_wolfe_head_only": lbfgs_head_only,
    "optimizer_resumed_from_state_dict": resume_optimizer_from_state_dict,
    "model_to_float64_and_back_mid_watch": float64_mid_watch,
    "generator_pipeline_next_in_cell": generator_pipeline,
    "numpy_metric_under_no_grad": numpy_metric_each_step,
    "tqdm_progress_set_postfix": tqdm_progress,
    "manual_seed_each_step_fork_rng_eval": seeded_each_step,
    "wgan_critic_weight_clipping": wgan_weight_clipping,
    "optimizer_step_hooks_of_the_user": optimizer_step_hooks,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_loop_shapes_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)


def test_the_rows_really_meet_what_they_handle() -> None:
    # (A row whose clipping never clips, whose generator never ran dry or whose hook never fired tests nothing.)
    torch.manual_seed(0)
    row = clip_value_with_frozen_layers()
    model = row.held[0]
    x, y = _data()
    F.cross_entropy(model(x), y).backward()
    assert model[0].weight.grad is None and model[2].weight.grad.abs().max() > 0.01
    row = hooks_removed_mid_loop()
    captured = row.run(lambda: contextlib.nullcontext())[1]
    assert len(captured) == 3  # two forward captures, one backward
    row = wgan_weight_clipping()
    row.run(lambda: contextlib.nullcontext())
    assert all(p.abs().max() <= 0.01 for p in row.held[1].parameters())


class Diverged(Exception):
    """The user's own error for a NaN they check for."""


class Checked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).log()  # producer: log of negatives
        if torch.isnan(h).any():
            raise Diverged("NaN in h")
        return h


def test_the_users_own_error_on_a_nan_is_still_explained() -> None:
    # The replay of a forward that raised runs for the user's own exception class where the traceback's frames
    # hold a non-finite tensor (their check read one): the report names the op and line that made it.
    import nan_magic
    from nan_magic.errors.exceptions import NonFiniteError

    torch.manual_seed(0)
    model = Checked()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        model(torch.randn(3, 4))
    report = caught.value.report
    assert report.phase == "forward" and report.op is not None and "log" in report.op
    assert report.source is not None and "producer: log of negatives" in report.source.line
    assert isinstance(caught.value.__cause__, Diverged)


def test_a_warning_from_inside_backward_names_the_users_line() -> None:
    import warnings

    import nan_magic

    row = root_backward_hook_without_input_grads()
    model, opt = row.held
    with warnings.catch_warnings(record=True) as caught, nan_magic.watch(model, opt):
        warnings.simplefilter("always")
        F.cross_entropy(model(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0])).backward()  # the line named
    fired = [w for w in caught if "Full backward hook is firing" in str(w.message)]
    assert fired and all(w.filename == __file__ for w in fired), [(w.filename, w.lineno) for w in fired]



def _backward_caller(how: str) -> tuple[object, int]:
    """Where the gradient check of a deferred watch found the loop's backward call (what %debug opens at for an
    event judged at the step's check, lifecycle/events.py), and the line of that call."""
    import inspect

    import nan_magic

    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    with nan_magic.watch(model, opt, defer=True) as w:
        loss = F.cross_entropy(model(x), y)
        line = inspect.currentframe().f_lineno + 2
        if how == "tensor":
            loss.backward()
        elif how == "function":
            torch.autograd.backward(loss)  # (line + 2)
        else:
            grads = torch.autograd.grad(loss, list(model.parameters()))  # (line + 4)
            for p, g in zip(model.parameters(), grads):
                p.grad = g
        caller = w.gradients.backward_caller
        opt.step()
    return caller, line + {"tensor": 0, "function": 2, "grad": 4}[how]


@pytest.mark.parametrize("how", ["tensor", "function", "grad"])
def test_the_gradient_check_finds_the_users_backward_line(how: str) -> None:
    # It looks a fixed number of frames up (hot/timing.py's loss_logged): the three backward patches are installed
    # alike (registry.SelfGated), whichever the loop calls; a frame of ours there would name nan_magic's code.
    caller, line = _backward_caller(how)
    code, _lasti, lineno = caller
    assert (code.co_filename, code.co_name, lineno) == (__file__, "_backward_caller", line)
