"""A deep model (48 blocks, ~150 modules) whose last block overflows: how long is the report in a CI log?"""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width, scale=1.0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.scale = scale

    def forward(self, x):
        return x + self.act(self.fc(self.norm(x))) * self.scale


torch.manual_seed(0)
model = nn.Sequential(*[Block(16) for _ in range(47)], Block(16, scale=1e39), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for _step in range(3):
    loss = model(torch.randn(4, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
