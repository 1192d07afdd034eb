"""Healthy models and objectives a user trains with the watch on (calm_s30), every mode.

Each row is a loop (tests/calm_s30.py: the harness, what is compared): parametrizations (orthogonal, a custom
one with a right inverse, cached), functional_call with a params dict each step, forward-mode AD (torch.func.jvp,
forward_ad dual tensors), nn.Transformer with padding masks and nested tensors, channels_last 3-d convolutions,
quantile and median losses, a masked softmax over a fully masked row that the user repairs by nan_to_num, a
torch.where(isfinite) guard on the batch, a hinge loss that is exactly 0 for a whole batch, a loss near 1e30 that
the user clips, weight tying, model ensembles by stack_module_state and vmap, a MAML inner loop.
test_calm_s30_loops.py: loop shapes (optimizers, schedules, loaders, anomaly mode, watches entered twice, ...).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from calm_s30 import MODES, Row, check, steps
from torch import nn
from torch.func import functional_call, jvp, stack_module_state, vmap
from torch.nn import functional as F
from torch.nn.utils import parametrizations, parametrize

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)

NEG_INF = float("-inf")


def _mlp(d_in: int = 6, d_out: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out))


def _data(n: int = 8, d_in: int = 6, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, d_in), torch.randint(0, classes, (n,))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _classifier(model: nn.Module, opt: torch.optim.Optimizer | None = None, n: int = 3) -> Row:
    opt = opt or _sgd(model)
    x, y = _data()
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(model(x), y), n))


# -- parametrizations ------------------------------------------------------------------------------------


def orthogonal(kind: str) -> Row:
    model = _mlp()
    parametrizations.orthogonal(model[0], orthogonal_map=kind)
    return _classifier(model)


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)

    def right_inverse(self, a: torch.Tensor) -> torch.Tensor:
        return a.triu()


class PositiveSpectrum(nn.Module):
    """A second parametrization on the same weight: softplus keeps every entry positive."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return F.softplus(w) * 0.1


def custom_parametrization(cached: bool) -> Row:
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    parametrize.register_parametrization(model[0], "weight", PositiveSpectrum())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()

    def loss_of(step: int) -> torch.Tensor:
        if cached:
            with parametrize.cached():  # the weight is computed once, used twice
                return F.cross_entropy(model(x), y) + F.cross_entropy(model(x.flip(0)), y.flip(0))
        return F.cross_entropy(model(x), y)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def spectral_and_weight_norm() -> Row:
    model = _mlp()
    parametrizations.spectral_norm(model[0])  # power iteration: buffers updated in training mode
    parametrizations.weight_norm(model[2])
    return _classifier(model, torch.optim.Adam(model.parameters(), lr=0.01))


# -- functional and forward-mode -------------------------------------------------------------------------


def functional_call_params_dict() -> Row:
    """The parameters live in a dict the loop updates by hand; the module is called with it each step."""
    model = _mlp()
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
        out = []
        with watching(model):
            for _ in range(3):
                loss = F.cross_entropy(functional_call(model, params, (x,)), y)
                grads = torch.autograd.grad(loss, list(params.values()))
                params = {k: (v - 0.1 * g).detach().requires_grad_() for (k, v), g in zip(params.items(), grads)}
                out.append(loss.detach())
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(params[k])
        return out

    return Row((model,), (model,), run)


def jvp_penalty() -> Row:
    """A directional-derivative (smoothness) penalty by torch.func.jvp over functional_call, trained through."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()
    direction = torch.randn_like(x)

    def loss_of(step: int) -> torch.Tensor:
        params = dict(model.named_parameters())
        out, tangent = jvp(lambda inp: functional_call(model, params, (inp,)), (x,), (direction,))
        return F.cross_entropy(out, y) + 0.01 * tangent.pow(2).mean()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def dual_tensors() -> Row:
    """forward_ad dual tensors through the model (a sensitivity the loop logs), then an ordinary step."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()
    direction = torch.randn_like(x)

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                with torch.no_grad(), torch.autograd.forward_ad.dual_level():
                    _, tangent = torch.autograd.forward_ad.unpack_dual(
                        model(torch.autograd.forward_ad.make_dual(x, direction)))
                    out.append(tangent.norm())
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def dual_tensors_trained_through() -> Row:
    """The loss reads the primal and the tangent of a dual-tensor forward (a sensitivity penalty), then backward."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()
    direction = torch.randn_like(x)
    fwd = torch.autograd.forward_ad

    def loss_of(step: int) -> torch.Tensor:
        with fwd.dual_level():
            primal, tangent = fwd.unpack_dual(model(fwd.make_dual(x, direction)))
            return F.cross_entropy(primal, y) + 0.01 * tangent.pow(2).mean()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def parametrization_changed_mid_watch(how: str) -> Row:
    """At step 2 the loop removes the orthogonal parametrization of the first layer (its class changes back), or
    adds weight_norm to the last layer and its two new parameters to the optimizer."""
    model = _mlp()
    if how == "remove":
        parametrizations.orthogonal(model[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for step in range(4):
                if step == 2 and how == "remove":
                    parametrize.remove_parametrizations(model[0], "weight")
                elif step == 2:
                    parametrizations.weight_norm(model[2])
                    opt.add_param_group({"params": list(model[2].parametrizations.weight.parameters())})
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def ensemble_by_vmap() -> Row:
    """Three copies stacked by stack_module_state and trained as one by vmap over functional_call."""
    base = _mlp()
    members = [_mlp() for _ in range(3)]
    params, buffers = stack_module_state(members)
    holder = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(v) for k, v in params.items()})
    opt = torch.optim.Adam(holder.parameters(), lr=0.01)
    x, y = _data()

    def one(p: dict, b: dict, inp: torch.Tensor) -> torch.Tensor:
        return functional_call(base, (p, b), (inp,))

    def loss_of(step: int) -> torch.Tensor:
        p = {k: holder[k.replace(".", "_")] for k in params}
        logits = vmap(one, in_dims=(0, 0, None))(p, buffers, x)
        return F.cross_entropy(logits.reshape(-1, 3), y.repeat(3))

    return Row((base, holder, opt), (base, holder, opt), steps(holder, opt, loss_of))


def maml_inner_loop() -> Row:
    """Two inner SGD steps by functional_call with create_graph, the outer Adam step through them."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    xs, ys = _data()
    xq, yq = _data()

    def loss_of(step: int) -> torch.Tensor:
        fast = dict(model.named_parameters())
        for _ in range(2):
            inner = F.cross_entropy(functional_call(model, fast, (xs,)), ys)
            grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
            fast = {k: v - 0.1 * g for (k, v), g in zip(fast.items(), grads)}
        return F.cross_entropy(functional_call(model, fast, (xq,)), yq)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


# -- transformers and convolutions -------------------------------------------------------------------------


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 16, padding_idx=0)
        self.core = nn.Transformer(16, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32,
                                   dropout=0.0, batch_first=True)
        self.out = nn.Linear(16, 12)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.core(self.embed(src), self.embed(tgt), tgt_mask=causal, src_key_padding_mask=src == 0,
                      tgt_key_padding_mask=tgt == 0, memory_key_padding_mask=src == 0)
        return self.out(h)


def _padded(b: int, t: int) -> torch.Tensor:
    tokens = torch.randint(1, 12, (b, t))
    for i in range(b):
        tokens[i, t - i:] = 0
    return tokens


def transformer_seq2seq() -> Row:
    model = Seq2Seq()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    src, tgt = _padded(4, 6), _padded(4, 5)

    def loss_of(step: int) -> torch.Tensor:
        logits = model(src, tgt[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 12), tgt[:, 1:].reshape(-1), ignore_index=0)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def nested_tensor_encoder_eval() -> Row:
    """An encoder with enable_nested_tensor: trained with a padding mask, evaluated under no_grad each step (the
    fast path turns the padded batch into a nested tensor and back, padding with 0)."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.Sequential()
    model.embed = nn.Embedding(12, 16, padding_idx=0)
    model.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    head = nn.Linear(16, 2)
    opt = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=1e-3)
    tokens, y = _padded(4, 6), torch.tensor([0, 1, 0, 1])

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching(model, head, opt):
            for _ in range(3):
                model.train()
                pad = tokens == 0
                h = model.encoder(model.embed(tokens), src_key_padding_mask=pad)
                loss = F.cross_entropy(head(h[:, 0]), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    out.append(model.encoder(model.embed(tokens), src_key_padding_mask=pad))
                out.append(loss.detach())
        return out

    return Row((model, head, opt), (model, head, opt), run)


def channels_last_3d() -> Row:
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(), nn.AdaptiveAvgPool3d(1),
                          nn.Flatten(), nn.Linear(4, 3)).to(memory_format=torch.channels_last_3d)
    opt = _sgd(model)
    x = torch.randn(4, 2, 5, 5, 5).to(memory_format=torch.channels_last_3d)
    y = torch.randint(0, 3, (4,))
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(model(x), y)))


# -- objectives ----------------------------------------------------------------------------------------------


def quantile_losses() -> Row:
    """A pinball loss at three quantiles plus a median absolute error and a torch.quantile of the residuals."""
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    qs = torch.tensor([0.1, 0.5, 0.9])

    def loss_of(step: int) -> torch.Tensor:
        r = y - model(x)
        pinball = torch.maximum(qs * r, (qs - 1) * r).mean()
        mad = r[:, 1].abs().median()
        upper = torch.quantile(r.abs().flatten(), 0.9)
        return pinball + 0.1 * mad + 0.01 * upper

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


class MaskedAttentionPool(nn.Module):
    """Attention pooling over a set with a mask; an empty set gives a fully masked row, whose softmax is NaN,
    which the module repairs by nan_to_num (its output and every gradient stay finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(8, 1)
        self.value = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        scores = self.score(x).squeeze(-1).masked_fill(~present, NEG_INF)
        weights = torch.softmax(scores, -1).nan_to_num(0.0)
        return self.head((weights.unsqueeze(-1) * self.value(x)).sum(1))


def fully_masked_row_repaired() -> Row:
    model = MaskedAttentionPool()
    opt = _sgd(model)
    x, y = torch.randn(4, 5, 8), torch.tensor([0, 1, 1, 0])
    present = torch.rand(4, 5) > 0.3
    present[2] = False
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(model(x, present), y)))


def isfinite_guard_on_the_batch() -> Row:
    """The batch has NaN and inf (missing and saturated readings); the loop replaces them before the model."""
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()
    x[1, 2], x[5, 0], x[6, 4] = float("nan"), float("inf"), float("-inf")

    def loss_of(step: int) -> torch.Tensor:
        clean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
        return F.cross_entropy(model(clean), y)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of), quiet=True)


def hinge_exactly_zero() -> Row:
    """A margin loss satisfied by every sample of the second batch: the loss is 0.0 and every gradient is 0."""
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    hard = torch.randn(6, 4)
    easy = torch.full((6, 4), 5.0)
    y = torch.ones(6)

    def loss_of(step: int) -> torch.Tensor:
        x = hard if step % 2 == 0 else easy
        return F.relu(1.0 - y * model(x).squeeze(-1)).mean()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of, 4), quiet=True)


def huge_loss_clipped() -> Row:
    """Unnormalised targets near 1e15 make a float32 loss near 1e30; clip_grad_norm_ keeps the step small."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 3), torch.full((8, 1), 1e15)

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                out.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
                opt.step()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run, quiet=True)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 20, bias=True)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(tokens) * math.sqrt(16))
        return self.lm_head(self.norm(h))


def tied_embedding_lm() -> Row:
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tokens = torch.randint(0, 20, (3, 7))

    def loss_of(step: int) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 20), tokens[:, 1:].reshape(-1))

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def half_copy_for_evaluation() -> Row:
    """A float16 copy of the model evaluates the batch each step (as for a deployment check), beside training."""
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
                served = copy.deepcopy(model).half().eval()
                with torch.no_grad():
                    out.append(served(x.half()).float())
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


def half_in_place_for_evaluation() -> Row:
    """model.half() for an evaluation, model.float() back for training (the parameters stay the same objects)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()

    def run(watching) -> list[torch.Tensor]:
        out = []
        with watching():
            for _ in range(3):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.half()
                with torch.no_grad():
                    out.append(model(x.half()).float())
                model.float()
                out.append(loss.detach())
        return out

    return Row((model, opt), (model, opt), run)


ROWS = {
    "orthogonal_matrix_exp": lambda: orthogonal("matrix_exp"),
    "orthogonal_householder": lambda: orthogonal("householder"),
    "custom_parametrization_stacked": lambda: custom_parametrization(False),
    "custom_parametrization_cached": lambda: custom_parametrization(True),
    "spectral_norm_and_weight_norm_parametrizations": spectral_and_weight_norm,
    "functional_call_params_dict_each_step": functional_call_params_dict,
    "func_jvp_smoothness_penalty": jvp_penalty,
    "forward_ad_dual_tensors_logged": dual_tensors,
    "forward_ad_dual_tensors_in_the_loss": dual_tensors_trained_through,
    "parametrization_removed_mid_watch": lambda: parametrization_changed_mid_watch("remove"),
    "parametrization_registered_mid_watch": lambda: parametrization_changed_mid_watch("register"),
    "ensemble_stack_module_state_vmap": ensemble_by_vmap,
    "maml_inner_loop_create_graph": maml_inner_loop,
    "transformer_seq2seq_padding_masks": transformer_seq2seq,
    "nested_tensor_encoder_eval_between_steps": nested_tensor_encoder_eval,
    "channels_last_3d_conv": channels_last_3d,
    "quantile_and_median_losses": quantile_losses,
    "fully_masked_softmax_row_nan_to_num": fully_masked_row_repaired,
    "isfinite_where_guard_on_the_batch": isfinite_guard_on_the_batch,
    "hinge_loss_exactly_zero_batch": hinge_exactly_zero,
    "loss_near_1e30_clipped": huge_loss_clipped,
    "tied_embedding_and_lm_head": tied_embedding_lm,
    "float16_copy_evaluates_each_step": half_copy_for_evaluation,
    "model_half_then_float_each_step": half_in_place_for_evaluation,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_models_and_objectives_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)


def test_the_rows_really_meet_what_they_handle() -> None:
    # (A row that stopped meeting its NaN, its 1e30 or its zero loss would pass without testing anything.)
    torch.manual_seed(0)
    model = MaskedAttentionPool()
    present = torch.ones(2, 5, dtype=torch.bool)
    present[1] = False
    scores = model.score(torch.randn(2, 5, 8)).squeeze(-1).masked_fill(~present, NEG_INF)
    assert torch.isnan(torch.softmax(scores, -1)[1]).all()
    row = huge_loss_clipped()
    loss = F.mse_loss(row.held[0](torch.randn(8, 3)), torch.full((8, 1), 1e15))
    assert 1e29 < loss.item() < 1e31
    row = hinge_exactly_zero()
    assert F.relu(1.0 - row.held[0](torch.full((6, 4), 5.0))).sum().item() == 0.0
