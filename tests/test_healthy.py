"""No false positive: healthy training runs raise nothing and record no event."""

from __future__ import annotations

import torch
from torch import nn

import nan_magic


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padding = tokens == 0
        hidden = self.encoder(self.embed(tokens), src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).float()
        return self.head((hidden * keep).sum(1) / keep.sum(1))


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(16, 4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def _train(model: nn.Module, batches, steps: int) -> nan_magic.Watch:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with nan_magic.watch(model, opt) as w:
        for step in range(steps):
            x, y = batches(step)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w


def test_transformer_with_padding_masks_trains_clean() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()

    def batches(step: int):
        tokens = torch.randint(1, 50, (8, 12))
        lengths = torch.randint(3, 12, (8,))
        tokens[torch.arange(12) >= lengths[:, None]] = 0  # padded tails: masked keys
        return tokens, (tokens[:, 0] % 2)

    w = _train(model, batches, 200)
    assert w.report is None and w.events == []
    assert w.step == 200
    assert all(summary.loss is not None and summary.absmax is not None for summary in w.history)


def test_cnn_with_batchnorm_trains_clean() -> None:
    torch.manual_seed(0)
    model = TinyCNN()

    def batches(step: int):
        return torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))

    w = _train(model, batches, 200)
    assert w.report is None and w.events == []
    assert w.step == 200
