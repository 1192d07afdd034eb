"""The demo: a small training run that blows up under the watch.

``python examples/train_blowup.py --out DIR`` (what ``./scripts/demo`` runs) trains a tiny attention model with a
hand-written softmax (``exp(s) / exp(s).sum()``, no max subtraction) and a
learning rate that is too high. After a few steps the attention scores grow
past ``log(float32 max) ~ 88.7``, ``exp`` overflows to +inf, and inf/inf is
NaN. The watch stops at that step, names the attention module, and the demo
prints the text report and writes ``report.html`` and ``report.json``.

The watch keeps the state of the last finite steps (``keep_last_good``), so
the report's fix trials can redo the update before the failing step at a
tenth of the learning rate: ``--lr 0.2`` is that fix applied by hand.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import nn

import nan_magic


class NaiveAttention(nn.Module):
    """Single-head self-attention with the textbook softmax that overflows."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-1, -2) / math.sqrt(x.shape[-1])
        weights = scores.exp() / scores.exp().sum(-1, keepdim=True)  # overflows for scores > 88.7
        return weights @ v


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = NaiveAttention(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def train(steps: int = 200, lr: float = 2.0) -> nan_magic.Watch:
    """Train until the watch stops the run; returns the watch."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    tokens = torch.randint(0, 64, (8, 16))
    w = nan_magic.watch(model, opt, labels=["model", "opt"], keep_last_good=True)
    try:
        with w:
            for _ in range(steps):
                logits = model(tokens[:, :-1])
                loss = loss_fn(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
    except nan_magic.NonFiniteError:
        pass
    return w


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo-output", help="folder for report.html and report.json")
    parser.add_argument("--lr", type=float, default=2.0, help="the learning rate (2.0 diverges)")
    args = parser.parse_args(argv)
    w = train(lr=args.lr)
    if w.report is None:
        print("the run stayed finite: nothing to report", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(w.report.to_text())
    w.report.to_html(str(out / "report.html"))
    (out / "report.json").write_text(w.report.to_json(indent=2))
    print(f"\nwrote {out / 'report.html'} and {out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
