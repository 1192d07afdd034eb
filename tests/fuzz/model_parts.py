"""A random model from parts: each node is a generated class of its own, with a slot in its ``forward`` where a
producer may be injected (so the producer's module and line are known by construction).

Every generated ``forward(self, h, aux)`` takes the activation ``h`` (``(B, D)``) and the batch's gate ``aux``
(``(B, 1)``) and returns the new ``h``; the standard modules (Linear, LayerNorm, BatchNorm1d, Conv1d, activations,
Embedding) are leaves inside these classes.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

SLOT = "<<slot>>"
SOFTMAX = "probs = scores.softmax(-1)"


@dataclass
class Node:
    """One generated class and the place of its instance in the model."""

    cls: str
    kind: str
    qualname: str
    init: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    children: list[Node] = field(default_factory=list)

    def walk(self) -> list[Node]:
        return [self, *(node for child in self.children for node in child.walk())]


class Builder:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.count = 0

    def _name(self, kind: str) -> str:
        self.count += 1
        return f"{kind.title().replace('_', '')}{self.count}"

    def leaf(self, qualname: str) -> Node:
        kind = self.rng.choice(("linear", "linear", "norm", "attn", "conv", "custom"))
        node = Node(self._name(kind), kind, qualname)
        if kind == "linear":
            act = self.rng.choice(("ReLU", "GELU", "Tanh", "SiLU"))
            node.init = ["self.lin = nn.Linear(D, D)", f"self.act = nn.{act}()"]
            node.body = ["h = self.act(self.lin(h))"]
        elif kind == "norm":
            norm = self.rng.choice(("nn.LayerNorm(D)", "nn.BatchNorm1d(D)"))
            node.init = [f"self.norm = {norm}"]
            node.body = ["h = self.norm(h)"]
        elif kind == "attn":
            node.init = ["self.qkv = nn.Linear(D, 3 * D)", "self.proj = nn.Linear(D, D)"]
            node.body = ["b = h.shape[0]",
                         "q, k, v = self.qkv(h).view(b, TOK, 3, D // TOK).unbind(2)",
                         "scores = q @ k.transpose(-1, -2) / math.sqrt(D // TOK)",
                         SOFTMAX,
                         "h = h + self.proj((probs @ v).reshape(b, D))"]
        elif kind == "conv":
            node.init = ["self.conv = nn.Conv1d(1, 2, 3, padding=1)"]
            node.body = ["c = self.conv(h.unsqueeze(1))", "h = h + c.mean(1)"]
        else:
            node.init = ["self.scale = nn.Parameter(torch.ones(D))"]
            node.body = ["g = torch.sigmoid(h) * self.scale", "h = h * g - 0.1 * h.mean(-1, keepdim=True)"]
        node.body.append(SLOT)
        return node

    def block(self, qualname: str, depth: int) -> Node:
        """A leaf, or (while ``depth`` allows) a residual wrapper or a group of 1-3 blocks."""
        shape = self.rng.choice(("leaf", "leaf", "residual", "list", "dict", "attrs")) if depth > 1 else "leaf"
        if shape == "leaf":
            return self.leaf(qualname)
        node = Node(self._name(shape), shape, qualname)
        prefix = f"{qualname}." if qualname else ""
        if shape == "residual":
            node.children = [self.block(f"{prefix}inner", depth - 1)]
            node.init = [f"self.inner = {node.children[0].cls}()"]
            if self.rng.random() < 0.3:  # activation checkpointing: the inner forward runs again in backward
                node.body = ["h = h + 0.5 * checkpoint(self.inner, h, aux, use_reentrant=False)"]
            else:
                node.body = ["h = h + 0.5 * self.inner(h, aux)"]
        elif shape == "list":
            node.children = [self.block(f"{prefix}layers.{i}", depth - 1) for i in range(self.rng.randint(1, 3))]
            node.init = ["self.layers = nn.ModuleList([" + ", ".join(f"{c.cls}()" for c in node.children) + "])"]
            node.body = ["for layer in self.layers:", "    h = layer(h, aux)"]
        elif shape == "dict":
            keys = ["enc", "mix", "out"][: self.rng.randint(1, 3)]
            node.children = [self.block(f"{prefix}parts.{key}", depth - 1) for key in keys]
            node.init = ["self.parts = nn.ModuleDict({" + ", ".join(
                f"{key!r}: {c.cls}()" for key, c in zip(keys, node.children)) + "})"]
            node.body = [f"for key in {tuple(keys)!r}:", "    h = self.parts[key](h, aux)"]
        else:
            node.children = [self.block(f"{prefix}first", depth - 1), self.block(f"{prefix}second", depth - 1)]
            node.init = [f"self.first = {node.children[0].cls}()", f"self.second = {node.children[1].cls}()"]
            node.body = ["h = self.first(h, aux)", "h = self.second(h, aux)"]
            if self.rng.random() < 0.3:
                node.body.append("h = self.first(h, aux)")  # a submodule called twice
        node.body.append(SLOT)
        return node


def model_tree(rng: random.Random, tokens: bool) -> Node:
    """The root ``Model``: an input layer, 1-3 blocks (nesting up to 3 deep), maybe a shared block called twice."""
    builder = Builder(rng)
    depth = rng.randint(1, 3)
    root = Node("Model", "root", "")
    root.children = [builder.block(f"b{i}", depth) for i in range(rng.randint(1, 3))]
    root.init = ["self.inp = nn.Embedding(16, D)" if tokens else "self.inp = nn.Linear(DIN, D)"]
    root.init += [f"self.b{i} = {child.cls}()" for i, child in enumerate(root.children)]
    root.body = ["h = self.inp(x)"] + [f"h = self.b{i}(h, aux)" for i in range(len(root.children))]
    if rng.random() < 0.3:
        shared = builder.leaf("shared")
        root.children.append(shared)
        root.init.append(f"self.shared = {shared.cls}()")
        root.body += ["h = self.shared(h, aux)", "h = self.shared(h, aux)"]
    root.init.append("self.head = nn.Linear(D, DOUT)")
    root.body += [SLOT, rng.choice(("return self.head(h)", "return {\"logits\": self.head(h)}"))]
    return root


def class_source(node: Node, replace: dict[str, list[str]]) -> list[str]:
    """The class of ``node``, each body line in ``replace`` replaced by its lines (an empty slot by none; the root's
    ``forward`` takes ``x`` and returns the head's output)."""
    args = "x, aux" if node.kind == "root" else "h, aux"
    lines = [f"class {node.cls}(nn.Module):", "    def __init__(self) -> None:", "        super().__init__()"]
    lines += [f"        {line}" for line in node.init]
    lines += ["", f"    def forward(self, {args}):"]
    for line in node.body:
        lines += [f"        {text}" for text in replace.get(line, [] if line == SLOT else [line])]
    if node.kind != "root":
        lines.append("        return h")
    return lines
