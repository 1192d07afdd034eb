"""Whole training programs as repositories write them stay calm and bit-identical in the five modes (issue 25;
harness: test_calm16.py's ``assert_calm``). Not single ops: each case is one notebook cell's worth of a known repo's
loop, every piece at once.

nanoGPT (train.py and model.py in small): tied embeddings, a causal mask buffer filled with -inf (or sdpa
``is_causal``), decay/no-decay AdamW groups, cosine lr with warmup set by hand on the param groups, gradient
accumulation, a GradScaler enabled only for float16 (disabled under bf16 and fp32: the repo's idiom), ``unscale_`` and
clipping, ``estimate_loss()`` in eval mode under no_grad every k steps, a checkpoint dict of state_dicts written by
``torch.save`` (read back, or loaded again into the same model and optimizer to roll back), and ``generate()`` with
top-k filtering by -inf inside the watched cell. A Hugging Face Trainer written out (tests/hf_models.py): weight
decay groups, linear warmup, accumulation, clipping, an evaluation loop that pads logits and labels across batches
with -100, metrics over the unmasked labels; models returning a ModelOutput, a dict, and one building its extended
mask with ``finfo.min``. DDPM: linear and cosine schedules, epsilon / v / x0 prediction with min-SNR weights, an EMA
made by ``deepcopy`` (in the cell or before it), ancestral sampling with the clipped log variance. Contrastive and
density objectives: test_calm17_objectives.py.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from test_calm16 import Loop, assert_calm
from torch import nn
from torch.nn import functional as F
from watching import FIVE_MODES

NEG_INF = float("-inf")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ---------------------------------------------------------------- nanoGPT


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, block: int, flash: bool) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.1), nn.Dropout(0.1)
        self.heads, self.flash = heads, flash
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, NEG_INF)
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, block: int, flash: bool) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), CausalSelfAttention(d, heads, block, flash), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 24, block: int = 8, d: int = 16, layers: int = 2, flash: bool = False) -> None:
        super().__init__()
        self.block = block
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, d),
                "wpe": nn.Embedding(block, d),
                "drop": nn.Dropout(0.1),
                "h": nn.ModuleList(Block(d, 2, block, flash) for _ in range(layers)),
                "ln_f": nn.LayerNorm(d),
            }
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:  # inference: only the last position
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.block else idx[:, -self.block :]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
        return idx


def nanogpt(
    dtype: str = "float32",
    accumulate: int = 2,
    flash: bool = False,
    roll_back: bool = False,
    iters: int = 6,
    eval_interval: int = 3,
):
    def build() -> Loop:
        data = {"train": torch.randint(0, 24, (200,)), "val": torch.randint(0, 24, (80,))}
        model = GPT(flash=flash)
        opt = model.configure_optimizers(weight_decay=0.1, lr=6e-3)
        scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"), init_scale=2.0**10)
        ctx_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
        warmup, decay_iters, max_lr, min_lr = 2, iters, 6e-3, 6e-4

        def ctx():
            return torch.autocast("cpu", dtype=ctx_dtype) if ctx_dtype else torch.autocast("cpu", enabled=False)

        def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
            ix = torch.randint(len(data[split]) - model.block, (4,))
            x = torch.stack([data[split][i : i + model.block] for i in ix])
            return x, torch.stack([data[split][i + 1 : i + 1 + model.block] for i in ix])

        def get_lr(it: int) -> float:
            if it < warmup:
                return max_lr * (it + 1) / (warmup + 1)
            ratio = (it - warmup) / (decay_iters - warmup)
            return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)

        @torch.no_grad()
        def estimate_loss() -> dict[str, torch.Tensor]:
            out = {}
            model.eval()
            for split in ("train", "val"):
                losses = torch.zeros(2)
                for k in range(2):
                    with ctx():
                        _, loss = model(*get_batch(split))
                    losses[k] = loss.item()
                out[split] = losses.mean()
            model.train()
            return out

        def run() -> list[torch.Tensor]:
            out, best_val_loss, checkpoint = [], 1e9, io.BytesIO()
            x, y = get_batch("train")
            for it in range(iters):
                for group in opt.param_groups:
                    group["lr"] = get_lr(it)
                if it % eval_interval == 0:
                    losses = estimate_loss()
                    out += [losses["train"], losses["val"]]
                    if losses["val"] < best_val_loss:
                        best_val_loss = losses["val"]
                        checkpoint = io.BytesIO()
                        torch.save(
                            {
                                "model": model.state_dict(),
                                "optimizer": opt.state_dict(),
                                "iter_num": it,
                                "best_val_loss": best_val_loss,
                            },
                            checkpoint,
                        )
                for _ in range(accumulate):
                    with ctx():
                        _, loss = model(x, y)
                        loss = loss / accumulate
                    x, y = get_batch("train")  # prefetch the next batch while the backward would run
                    scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                out.append(loss.detach().float() * accumulate)
            checkpoint.seek(0)
            saved = torch.load(checkpoint, weights_only=True)
            out += list(saved["model"].values())
            if roll_back:  # back to the best checkpoint, two more steps from there
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["optimizer"])
                for _ in range(2):
                    _, loss = model(x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    out.append(loss.detach())
            model.eval()
            out.append(model.generate(torch.zeros(2, 1, dtype=torch.long), 10, temperature=0.8, top_k=5))
            model.train()
            return out

        return Loop((model, opt, scaler), (model, opt, scaler), run)

    return build


# ---------------------------------------------------------------- a Hugging Face Trainer, written out


class TokenTagger(nn.Module):
    """A token classifier building BERT's extended mask, ``(1 - mask) * finfo.min``; returns a ModelOutput or a
    plain dict as many research repos do."""

    def __init__(self, as_dict: bool, vocab: int = 128, d: int = 16, tags: int = 5) -> None:
        super().__init__()
        self.as_dict = as_dict
        self.emb, self.qkv, self.norm = nn.Embedding(vocab, d, padding_idx=0), nn.Linear(d, 3 * d), nn.LayerNorm(d)
        self.classifier = nn.Linear(d, tags)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None = None):
        from transformers.modeling_outputs import TokenClassifierOutput

        h = self.emb(input_ids)
        q, k, v = self.qkv(h).chunk(3, -1)
        extended = (1.0 - attention_mask[:, None, :].to(h.dtype)) * torch.finfo(h.dtype).min
        h = self.norm(h + (q @ k.transpose(1, 2) / 4.0 + extended).softmax(-1) @ v)
        logits = self.classifier(h)
        loss = None if labels is None else F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        if self.as_dict:
            return {"loss": loss, "logits": logits}
        return TokenClassifierOutput(loss=loss, logits=logits)


class Trainer:
    """The parts of ``transformers.Trainer`` a loop exercises, written out (as people copy them)."""

    def __init__(self, model: nn.Module, train: list[dict], evals: list[dict], accumulate: int, epochs: int) -> None:
        from transformers import get_linear_schedule_with_warmup

        self.model, self.train_batches, self.eval_batches = model, train, evals
        self.accumulate, self.epochs = accumulate, epochs
        no_decay = ("bias", "LayerNorm.weight", "norm.weight")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
                {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
            ],
            lr=5e-3,
        )
        total = len(train) // accumulate * epochs
        self.lr_scheduler = get_linear_schedule_with_warmup(self.optimizer, 1, total)

    def compute_loss(self, inputs: dict) -> torch.Tensor:
        outputs = self.model(**inputs)
        return outputs["loss"] if isinstance(outputs, dict) else outputs[0]

    def train(self) -> list[torch.Tensor]:
        logged, tr_loss = [], torch.tensor(0.0)
        self.model.zero_grad()
        for _ in range(self.epochs):
            for step, inputs in enumerate(self.train_batches):
                self.model.train()
                loss = self.compute_loss(inputs) / self.accumulate
                loss.backward()
                tr_loss += loss.detach()
                if (step + 1) % self.accumulate == 0:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                    self.optimizer.step()
                    self.lr_scheduler.step()
                    self.model.zero_grad()
                    logged.append(tr_loss.clone())
            logged += self.evaluate()
        return logged

    @staticmethod
    def _pad_across(tensors: list[torch.Tensor]) -> torch.Tensor:
        """``nested_concat``: batches of other lengths padded with -100 on the sequence axis, then concatenated."""
        longest = max(t.shape[1] for t in tensors)
        return torch.cat([F.pad(t, (0, 0) * (t.dim() - 2) + (0, longest - t.shape[1]), value=-100) for t in tensors])

    def evaluate(self) -> list[torch.Tensor]:
        self.model.eval()
        all_logits, all_labels, losses = [], [], []
        for inputs in self.eval_batches:
            with torch.no_grad():
                outputs = self.model(**inputs)
            losses.append(outputs["loss"])
            logits = outputs["logits"]
            if logits.dim() == 3:
                all_logits.append(logits)
                all_labels.append(inputs["labels"])
        self.model.train()
        metrics = [torch.stack(losses).mean()]
        if all_logits:
            logits, labels = self._pad_across(all_logits), self._pad_across(all_labels)
            keep = labels != -100
            metrics.append((logits.argmax(-1)[keep] == labels[keep]).float().mean())
        return metrics


def trainer(kind: str):
    hf_models = pytest.importorskip("hf_models")

    def batch(length: int) -> dict:
        b = hf_models.padded_batch(batch=3, length=length)
        if kind == "bert-sequence":
            b["labels"] = torch.randint(0, 3, (3,))
        elif kind.startswith("tagger"):
            b["labels"] = torch.randint(0, 5, b["input_ids"].shape).masked_fill(b["attention_mask"] == 0, -100)
        return b

    def build() -> Loop:
        model = {
            "bert-sequence": lambda: hf_models.bert(),
            "gpt2-causal-lm": lambda: hf_models.gpt2(),
            "tagger-model-output": lambda: TokenTagger(as_dict=False),
            "tagger-dict": lambda: TokenTagger(as_dict=True),
        }[kind]()
        train = [batch(8) for _ in range(4)]
        evals = [batch(8), batch(6)]
        t = Trainer(model, train, evals, accumulate=2, epochs=2)
        return Loop((model, t.optimizer), (model, t.optimizer), t.train)

    return build


# ---------------------------------------------------------------- DDPM


class Denoiser(nn.Module):
    """An MLP on 2-D points with a sinusoidal time embedding (the diffusion tutorials' toy model)."""

    def __init__(self, steps: int, d: int = 32) -> None:
        super().__init__()
        self.steps = steps
        self.net = nn.Sequential(nn.Linear(2 + 16, d), nn.SiLU(), nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 2))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-math.log(10000) * torch.arange(8) / 8)
        angles = t[:, None].float() * freqs[None]
        return self.net(torch.cat([x, angles.sin(), angles.cos()], -1))


def _schedule(kind: str, steps: int) -> torch.Tensor:
    if kind == "linear":
        return torch.linspace(1e-4, 0.02 * 1000 / steps, steps)
    s = 0.008  # improved DDPM's cosine schedule, betas clipped below 0.999
    f = torch.cos((torch.linspace(0, steps, steps + 1) / steps + s) / (1 + s) * math.pi / 2) ** 2
    return (1 - f[1:] / f[:-1]).clamp(max=0.999)


def ddpm(target: str, schedule: str, ema_in_cell: bool):
    steps = 20

    def build() -> Loop:
        model = Denoiser(steps)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        betas = _schedule(schedule, steps)
        alphas = 1.0 - betas
        ac = torch.cumprod(alphas, 0)
        ac_prev = F.pad(ac[:-1], (1, 0), value=1.0)
        post_var = betas * (1.0 - ac_prev) / (1.0 - ac)  # 0 at t = 0: its log is taken clipped
        post_log_var = torch.log(torch.cat([post_var[1:2], post_var[1:]]))
        data = [torch.randn(16, 2) * 0.5 + torch.tensor([1.0, -1.0]) for _ in range(4)]
        held_ema = None if ema_in_cell else copy.deepcopy(model).requires_grad_(False).eval()

        def run() -> list[torch.Tensor]:
            ema = held_ema if held_ema is not None else copy.deepcopy(model).requires_grad_(False).eval()
            out = []
            for x0 in data:
                t = torch.randint(0, steps, (x0.shape[0],))
                noise = torch.randn_like(x0)
                a, s = ac[t].sqrt()[:, None], (1 - ac[t]).sqrt()[:, None]
                xt = a * x0 + s * noise
                pred = model(xt, t)
                if target == "v":
                    loss = F.mse_loss(pred, a * noise - s * x0)
                elif target == "x0-min-snr":
                    snr = ac[t] / (1 - ac[t])
                    weight = torch.minimum(snr, torch.full_like(snr, 5.0))
                    loss = (weight[:, None] * (pred - x0) ** 2).mean()
                else:
                    loss = F.mse_loss(pred, noise)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                with torch.no_grad():
                    for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                        pe.mul_(0.9).add_(p, alpha=0.1)
                out.append(loss.detach())
            with torch.no_grad():  # ancestral sampling with the EMA model
                x = torch.randn(8, 2)
                for i in reversed(range(steps)):
                    t = torch.full((8,), i)
                    pred = ema(x, t)
                    if target == "v":
                        x0 = ac[i].sqrt() * x - (1 - ac[i]).sqrt() * pred
                    elif target == "x0-min-snr":
                        x0 = pred
                    else:
                        x0 = (x - (1 - ac[i]).sqrt() * pred) / ac[i].sqrt()
                    x0 = x0.clamp(-3, 3)
                    coef0 = betas[i] * ac_prev[i].sqrt() / (1 - ac[i])
                    coeft = (1 - ac_prev[i]) * alphas[i].sqrt() / (1 - ac[i])
                    mean = coef0 * x0 + coeft * x
                    x = mean + (0.5 * post_log_var[i]).exp() * torch.randn_like(x) * (i > 0)
            return [*out, x, *(p.detach().clone() for p in ema.parameters())]

        return Loop((model, opt), (model, opt), run)

    return build


PROGRAMS = {
    "nanogpt-fp32-accumulate": nanogpt("float32"),
    "nanogpt-bf16-disabled-scaler": nanogpt("bfloat16"),
    "nanogpt-fp16-scaler": nanogpt("float16"),
    "nanogpt-flash-no-accumulation": nanogpt("float32", accumulate=1, flash=True),
    "nanogpt-roll-back-to-checkpoint": nanogpt("float32", roll_back=True),
    "trainer-bert-sequence": trainer("bert-sequence"),
    "trainer-gpt2-causal-lm": trainer("gpt2-causal-lm"),
    "trainer-tagger-model-output-finfo-min": trainer("tagger-model-output"),
    "trainer-tagger-dict-finfo-min": trainer("tagger-dict"),
    "ddpm-eps-linear-ema-before": ddpm("eps", "linear", ema_in_cell=False),
    "ddpm-v-cosine-ema-deepcopied-in-cell": ddpm("v", "cosine", ema_in_cell=True),
    "ddpm-x0-min-snr-cosine": ddpm("x0-min-snr", "cosine", ema_in_cell=False),
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", PROGRAMS)
def test_whole_training_programs_are_calm_and_identical(name: str, options: dict) -> None:
    assert_calm(PROGRAMS[name], options)


def test_the_programs_really_do_what_they_claim() -> None:
    """Guards against a moot case: top-k wrote -inf into the logits generate() samples from."""
    torch.manual_seed(0)
    model = GPT(flash=True).eval()  # sdpa: the only softmax is generate's
    seen = []
    real_softmax = F.softmax

    def spy(logits, dim=None, **kw):
        seen.append(bool(torch.isinf(logits).any()))
        return real_softmax(logits, dim=dim, **kw)

    F.softmax = spy
    try:
        model.generate(torch.zeros(1, 1, dtype=torch.long), 2, top_k=5)
    finally:
        F.softmax = real_softmax
    assert any(seen)
