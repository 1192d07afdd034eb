"""A user's training library: the model, the loss and the loop live here, the script only calls them."""
import torch
from torch import nn


class LogHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, h):
        z = self.proj(h)
        return torch.log(z)  # negative inputs: NaN in forward


class Net(nn.Module):
    def __init__(self, bad_forward=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = LogHead() if bad_forward else nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.body(x))


def my_loss(out, y, kind):
    if kind == "loss":
        p = torch.softmax(out, -1) - 0.5
        return torch.log(p).mean()  # NaN in the loss code
    if kind == "backward":
        d = (out - out).pow(2).sum(-1)
        return torch.sqrt(d).mean() + (out - y).pow(2).mean()  # sqrt'(0) = inf: NaN in backward
    return (out - y).pow(2).mean()


def train_step(model, opt, x, y, kind):
    out = model(x)
    loss = my_loss(out, y, kind)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def train(model, opt, steps, kind, bad_data_step=None):
    torch.manual_seed(1)
    losses = []
    for step in range(steps):
        x, y = torch.randn(16, 4), torch.randn(16, 4)
        if bad_data_step == step:
            x[3, 2] = float("nan")
        losses.append(train_step(model, opt, x, y, kind))
    return losses
