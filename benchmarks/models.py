"""The four benchmark models of issue 6, in plain torch, each with a full training step.

Every model is built from ``torch.nn`` only (no torchvision, no ``transformers``, no
downloads), randomly initialised from a fixed seed, so the benchmarks run anywhere the
package runs:

- ``mlp``: 8 hidden ``Linear(1024, 1024)`` + ReLU layers and a 10-way classifier head,
  batch 64, AdamW.
- ``resnet18``: a ResNet-18 (ImageNet stem, BasicBlocks ``[2, 2, 2, 2]``, BatchNorm),
  batch 8 of 3x64x64 images, 100 classes, SGD with momentum.
- ``bert``: a 6-layer post-LayerNorm BERT encoder (hidden 256, 4 heads, FFN 1024),
  seq 128, batch 8, right-padded sequences with an additive padding mask, masked-LM loss
  through a weight-tied head, AdamW.
- ``gpt2``: a 6-layer pre-LayerNorm GPT-2 decoder (hidden 256, 4 heads, FFN 1024),
  seq 128, batch 4, causal mask, next-token loss through a weight-tied head, AdamW.
- ``gpt2_small``: the same decoder at GPT-2 small's size (12 layers, hidden 768, 12
  heads, FFN 3072, vocabulary 50257), batch 8 x 512 tokens, under bfloat16 autocast:
  the GPU-bound model of issue 17's CUDA table. Not in the CPU tables (:data:`GPU_ONLY`):
  a step of it takes minutes on a laptop's cores.

Both transformers use a vocabulary of 8192 rather than BERT's 30522 or GPT-2's 50257:
with the real vocabularies the embedding and the output softmax dominate the step, which
would dilute any per-layer overhead; the smaller vocabulary keeps the per-layer work
dominant and therefore makes the overhead ratios harder to meet, not easier.

The attention is written out op by op (as in Hugging Face's eager BERT and in nanoGPT's
non-flash path) rather than through ``scaled_dot_product_attention``, so that op-level
watchers see every matmul, mask and softmax. BERT masks padding with an additive
``finfo.min`` bias (finite, as Hugging Face does); GPT-2 masks the future with
``masked_fill(-inf)`` (as nanoGPT/minGPT do), a deliberate infinity whose softmax is finite.

Each model yields a :class:`Benchmark`: the module, its optimizer, one fixed batch already
on the device, and :meth:`Benchmark.train_step` (zero_grad, forward, loss, backward,
optimizer step). The batch is made once so that data generation is never timed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

VOCAB = 8192
HIDDEN = 256
HEADS = 4
FFN = 1024
LAYERS = 6
SEQ = 128


@dataclass
class Benchmark:
    """One model, its optimizer and a fixed batch, ready for timed training steps.

    Attributes
    ----------
    name:
        Short key used on the command line and in tables (``mlp``, ``resnet18``...).
    description:
        One line for table headers: architecture, batch and input size.
    model:
        The module under test, in training mode.
    optimizer:
        Optimizer over ``model.parameters()``.
    batch:
        Tensors the loss function takes, already on the model's device.
    loss_fn:
        ``loss_fn(model, *batch)`` returns the scalar training loss.
    """

    name: str
    description: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple[Tensor, ...]
    loss_fn: Callable[..., Tensor]
    #: Forward and loss run under ``torch.autocast`` to this dtype (None: in the model's own dtype).
    autocast: torch.dtype | None = None

    def train_step(self) -> None:
        """Run one full training step: zero_grad, forward, loss, backward, optimizer step.

        The loss is never read on the host (no ``.item()``), so an unwatched step makes
        no host synchronisation on CUDA and any sync counted is the watcher's.
        """
        self.optimizer.zero_grad(set_to_none=True)
        device = self.batch[0].device.type
        with torch.autocast(device, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            loss = self.loss_fn(self.model, *self.batch)
        loss.backward()
        self.optimizer.step()


# --------------------------------------------------------------------------- MLP


def _mlp(device: torch.device) -> Benchmark:
    width, depth, classes, batch = 1024, 8, 10, 64
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, classes)).to(device)
    x = torch.randn(batch, width, device=device)
    y = torch.randint(0, classes, (batch,), device=device)

    def loss_fn(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(m(x), y)

    return Benchmark(
        "mlp",
        f"MLP, {depth}x Linear({width}) + ReLU, batch {batch}, AdamW",
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        (x, y),
        loss_fn,
    )


# ---------------------------------------------------------------------- ResNet-18


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with BatchNorm and an identity/projection skip."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        # In-place add and ReLU as torchvision does: watchers must cope with in-place ops.
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision's resnet18 layout, written out so no torchvision is needed."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages: list[nn.Module] = []
        cin = 64
        for i, cout in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _resnet18(device: torch.device) -> Benchmark:
    classes, batch, size = 100, 8, 64
    model = ResNet18(classes).to(device)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, classes, (batch,), device=device)

    def loss_fn(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(m(x), y)

    return Benchmark(
        "resnet18",
        f"ResNet-18, batch {batch}, {size}x{size}, SGD momentum",
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4),
        (x, y),
        loss_fn,
    )


# --------------------------------------------------------------------------- BERT


class BertSelfAttention(nn.Module):
    """Multi-head self-attention as in Hugging Face's eager ``BertSelfAttention``."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.dropout = nn.Dropout(0.1)

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, HEADS, HIDDEN // HEADS).transpose(1, 2)

    def forward(self, x: Tensor, mask_bias: Tensor) -> Tensor:
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(HIDDEN // HEADS) + mask_bias
        probs = self.dropout(scores.softmax(dim=-1))
        return (probs @ v).transpose(1, 2).reshape(x.shape)


class BertLayer(nn.Module):
    """Post-LayerNorm encoder layer: attention, add & norm, GELU FFN, add & norm."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = BertSelfAttention()
        self.attention_output = nn.Linear(HIDDEN, HIDDEN)
        self.attention_norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.intermediate = nn.Linear(HIDDEN, FFN)
        self.output = nn.Linear(FFN, HIDDEN)
        self.output_norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: Tensor, mask_bias: Tensor) -> Tensor:
        a = self.dropout(self.attention_output(self.attention(x, mask_bias)))
        x = self.attention_norm(x + a)
        h = self.dropout(self.output(F.gelu(self.intermediate(x))))
        return self.output_norm(x + h)


class BertMLM(nn.Module):
    """BERT encoder with embeddings and a weight-tied masked-LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)
        self.token_type_embeddings = nn.Embedding(2, HIDDEN)
        self.embeddings_norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.dropout = nn.Dropout(0.1)
        self.layer = nn.ModuleList(BertLayer() for _ in range(LAYERS))
        self.head_transform = nn.Linear(HIDDEN, HIDDEN)
        self.head_norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.decoder_bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, ids: Tensor, attention_mask: Tensor) -> Tensor:
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(pos)
        x = x + self.token_type_embeddings(torch.zeros_like(ids))
        x = self.dropout(self.embeddings_norm(x))
        # Hugging Face's extended mask: 0 where attended, finfo.min on padded keys.
        mask_bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layer:
            x = layer(x, mask_bias)
        h = self.head_norm(F.gelu(self.head_transform(x)))
        return F.linear(h, self.word_embeddings.weight, self.decoder_bias)


def _bert(device: torch.device) -> Benchmark:
    batch = 8
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (batch,), generator=gen)
    attention_mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    # Masked LM: predict 15% of the real (non-pad) tokens; -100 is ignored by the loss.
    chosen = (torch.rand(batch, SEQ, generator=gen) < 0.15) & attention_mask.bool()
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    model = BertMLM().to(device)

    def loss_fn(m: nn.Module, ids: Tensor, attention_mask: Tensor, labels: Tensor) -> Tensor:
        logits = m(ids, attention_mask)
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)

    return Benchmark(
        "bert",
        f"BERT encoder, {LAYERS} layers, hidden {HIDDEN}, seq {SEQ}, batch {batch}, AdamW",
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        (ids.to(device), attention_mask.to(device), labels.to(device)),
        loss_fn,
    )


# -------------------------------------------------------------------------- GPT-2


@dataclass(frozen=True)
class GPT2Config:
    """A GPT-2 decoder's size; the default is the CPU benchmark's ``gpt2``."""

    layers: int = LAYERS
    hidden: int = HIDDEN
    heads: int = HEADS
    ffn: int = FFN
    vocab: int = VOCAB
    seq: int = SEQ


#: GPT-2 small (124M parameters) at a 512-token context: the GPU-bound model.
GPT2_SMALL = GPT2Config(layers=12, hidden=768, heads=12, ffn=3072, vocab=50257, seq=512)


class CausalSelfAttention(nn.Module):
    """GPT-2 attention with a fused QKV projection and a ``-inf`` causal mask (nanoGPT)."""

    bias: Tensor

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.hidden, self.heads = config.hidden, config.heads
        self.c_attn = nn.Linear(config.hidden, 3 * config.hidden)
        self.c_proj = nn.Linear(config.hidden, config.hidden)
        self.attn_dropout = nn.Dropout(0.1)
        self.resid_dropout = nn.Dropout(0.1)
        self.register_buffer("bias", torch.tril(torch.ones(config.seq, config.seq, dtype=torch.bool)))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.hidden, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        att = att.masked_fill(~self.bias[:t, :t], float("-inf"))
        att = self.attn_dropout(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class GPT2Block(nn.Module):
    """Pre-LayerNorm decoder block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden, config.ffn),
            nn.GELU(approximate="tanh"),
            nn.Linear(config.ffn, config.hidden),
            nn.Dropout(0.1),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2LM(nn.Module):
    """GPT-2 decoder with learned positions and a weight-tied LM head."""

    def __init__(self, config: GPT2Config = GPT2Config()) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab, config.hidden)
        self.wpe = nn.Embedding(config.seq, config.hidden)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: Tensor) -> Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2_benchmark(
    device: torch.device, config: GPT2Config = GPT2Config(), batch: int = 4, autocast: torch.dtype | None = None,
    name: str = "gpt2",
) -> Benchmark:
    """A GPT-2 decoder of ``config``'s size training on one fixed batch of random tokens."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab, (batch, config.seq), generator=gen)
    model = GPT2LM(config).to(device)

    def loss_fn(m: nn.Module, ids: Tensor) -> Tensor:
        logits = m(ids)
        # Next-token prediction: position t predicts token t + 1.
        return F.cross_entropy(logits[:, :-1].reshape(-1, config.vocab), ids[:, 1:].reshape(-1))

    precision = f", {str(autocast).removeprefix('torch.')} autocast" if autocast is not None else ""
    return Benchmark(
        name,
        f"GPT-2 decoder, {config.layers} layers, hidden {config.hidden}, seq {config.seq}, batch {batch}, "
        f"AdamW{precision}",
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        (ids.to(device),),
        loss_fn,
        autocast,
    )


def _gpt2(device: torch.device) -> Benchmark:
    return gpt2_benchmark(device)


def _gpt2_small(device: torch.device) -> Benchmark:
    return gpt2_benchmark(device, GPT2_SMALL, batch=8, autocast=torch.bfloat16, name="gpt2_small")


BUILDERS: dict[str, Callable[[torch.device], Benchmark]] = {
    "mlp": _mlp,
    "resnet18": _resnet18,
    "bert": _bert,
    "gpt2": _gpt2,
    "gpt2_small": _gpt2_small,
}
"""Benchmark name -> builder, in the order the tables list them."""

#: Models measured only on a GPU by default (``--models`` still takes them anywhere).
GPU_ONLY = ("gpt2_small",)


def default_models(device: str) -> list[str]:
    """The models a table lists by default on ``device``: all four, and on a GPU the GPU-bound one too."""
    return [name for name in BUILDERS if device == "cuda" or name not in GPU_ONLY]


def build(name: str, device: torch.device | str = "cpu", seed: int = 0) -> Benchmark:
    """Build benchmark ``name`` on ``device`` with a fixed seed, in training mode.

    Parameters
    ----------
    name:
        One of :data:`BUILDERS`.
    device:
        Where the model, its optimizer state and the batch live.
    seed:
        Seed for the weights and the batch, so every run times the same work.
    """
    torch.manual_seed(seed)
    bench = BUILDERS[name](torch.device(device))
    bench.model.train()
    return bench


# ------------------------------------------------------------------ launch-bound models
#
# Tiny models whose training step, on one CPU thread, is a few milliseconds made of many
# small ops: dispatch and Python dominate, as on a launch-bound GPU step (a small model on a
# Colab T4, a large one at batch 1). benchmarks/launch_bound.py times them; what a watch
# adds per step and per module call shows there undiluted.


def _tiny_lm(device: torch.device) -> Benchmark:
    config = GPT2Config(layers=6, hidden=32, heads=4, ffn=128, vocab=256, seq=16)
    return gpt2_benchmark(device, config, batch=2, name="tiny_lm")


def _deep_mlp(device: torch.device) -> Benchmark:
    width, depth, classes, batch = 64, 16, 10, 16
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, classes)).to(device)
    x = torch.randn(batch, width, device=device)
    y = torch.randint(0, classes, (batch,), device=device)

    def loss_fn(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(m(x), y)

    return Benchmark(
        "deep_mlp", f"MLP, {depth}x Linear({width}) + LayerNorm + ReLU, batch {batch}, Adam", model,
        torch.optim.Adam(model.parameters(), lr=1e-4), (x, y), loss_fn,
    )


class SmallCNN(nn.Module):
    """Four conv + BatchNorm + ReLU stages, global pooling and a linear head."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        stages: list[nn.Module] = []
        cin = 3
        for cout, stride in ((16, 1), (32, 2), (32, 1), (64, 2)):
            conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            stages.append(nn.Sequential(conv, nn.BatchNorm2d(cout), nn.ReLU()))
            cin = cout
        self.features = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


def _small_cnn(device: torch.device) -> Benchmark:
    classes, batch, size = 10, 8, 16
    model = SmallCNN(classes).to(device)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, classes, (batch,), device=device)

    def loss_fn(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(m(x), y)

    return Benchmark(
        "small_cnn", f"CNN, 4x Conv + BatchNorm + ReLU, batch {batch}, {size}x{size}, SGD momentum", model,
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), (x, y), loss_fn,
    )


#: The launch-bound regime's models (benchmarks/launch_bound.py): name -> builder.
LAUNCH_BOUND: dict[str, Callable[[torch.device], Benchmark]] = {
    "tiny_lm": _tiny_lm,
    "deep_mlp": _deep_mlp,
    "small_cnn": _small_cnn,
}


def build_launch_bound(name: str, device: torch.device | str = "cpu", seed: int = 0) -> Benchmark:
    """Build launch-bound model ``name`` (:data:`LAUNCH_BOUND`) as :func:`build` builds the others."""
    torch.manual_seed(seed)
    bench = LAUNCH_BOUND[name](torch.device(device))
    bench.model.train()
    return bench
