"""A map-style Dataset whose __getitem__ makes a NaN for one index, read by DataLoader workers.

python loader.py [WORKERS]; run it plain, or as ``python -m nan_magic run loader.py 2``.
"""
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Features(Dataset):
    def __init__(self):
        torch.manual_seed(0)
        self.raw = torch.randn(64, 4)
        self.raw[37] = 3.0  # a constant row: its std is 0

    def __len__(self):
        return len(self.raw)

    def __getitem__(self, index):
        row = self.raw[index]
        return (row - row.mean()) / row.std(), row.sum()  # 0 / 0 for the constant row


def main(workers):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(Features(), batch_size=8, shuffle=False, num_workers=workers)
    for x, y in loader:
        loss = (model(x).squeeze(-1) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("done")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
