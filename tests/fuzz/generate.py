"""One incident from a seed: a Python source file (model, loss, loop) with one producer at one site, and its truth.

The file defines ``build(armed=True)`` returning a contract :class:`~contract.Scenario` ``((model, opt), run)``;
``build(False)`` is the healthy twin (the same lines, the gate never closed). The producer's line ends with
``# producer`` (a contract row's marker), so the truth's line is where that comment is.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from fuzz.model_parts import SLOT, SOFTMAX, Node, class_source, model_tree
from fuzz.producers import BACKWARD, FORWARD, IN_PLACE, MASKED_SOFTMAX, Producer, fill, in_place

PHASE_OF_SITE = {"module": "forward", "loss": "forward", "update": "optimizer", "data": "data"}


@dataclass(frozen=True)
class Truth:
    """What the report must say, by construction."""

    seed: int
    site: str  # module | loss | update | data
    producer: str
    phase: str
    module: str | None
    ops: tuple[str, ...]
    line: int
    step: int
    path: str
    detail: str  # the site in words: which class, helper, optimizer

    def key(self) -> str:
        return f"{self.site}/{self.producer}"


# Data producers: (the batch field, its raw expression, the arming line, the preprocessing line, its ops).
DATA = {
    "standardise": ("x", "torch.randn(B, DIN, generator=g)", "x[:, 1] = 0.25",
                    "x = (x - x.mean(0)) / x.std(0)", ("aten.div.Tensor",)),
    "log": ("x", "torch.randn(B, DIN, generator=g).abs() + 0.5", "x[ROWS, 2] = 0.0", "x = torch.log(x)",
            ("aten.log.default",)),
    "row_norm": ("x", "torch.randn(B, DIN, generator=g)", "x[ROWS] = 0.0", "x = x / x.norm(dim=-1, keepdim=True)",
                 ("aten.div.Tensor",)),
    "target_standardise": ("y", "torch.randn(B, DOUT, generator=g)", "y[:, 0] = 0.5",
                           "y = (y - y.mean(0)) / y.std(0)", ("aten.div.Tensor",)),
}

# Update producers: the lines after ``loss.backward()``, before ``opt.step()``.
# (An lr that overflows is left out: which parameter's update passes float32's max first depends on the numbers,
# and an lr past it fails torch's own scalar conversion before any op runs.)
UPDATE = ("hand_divide_by_count", "parameter_write")
# A validation pass after each step, in eval mode under no_grad, on a healthy batch of its own (gate open).
VALIDATE = ("model.eval()", "with torch.no_grad():", "    model(data[0][0], torch.ones(B, 1))", "model.train()")
LOSSES = ("F.mse_loss(out, y)", "F.l1_loss(out, y)", "F.smooth_l1_loss(out, y)", "(out - y).pow(2).mean()")


def _parameters(root: Node) -> list[tuple[str, str]]:
    """(parameter name, owning module) of the generated model, for an update that writes one."""
    own = {"linear": ("lin", "weight"), "attn": ("qkv", "weight"), "conv": ("conv", "weight"),
           "norm": ("norm", "weight")}
    found = [("inp.weight", "inp"), ("head.weight", "head"), ("head.bias", "head")]
    for node in root.walk():
        if node.kind in own:
            child, name = own[node.kind]
            found.append((f"{node.qualname}.{child}.{name}", f"{node.qualname}.{child}"))
        elif node.kind == "custom":
            found.append((f"{node.qualname}.scale", node.qualname))
    return found


def incident(seed: int, directory: Path) -> Truth:
    """Write incident ``seed`` into ``directory`` (as ``fuzz_<seed>.py``) and return its truth."""
    rng = random.Random(seed)
    site = rng.choices(("module", "loss", "update", "data"), weights=(50, 20, 15, 15))[0]
    tokens = site != "data" and rng.random() < 0.25
    root = model_tree(rng, tokens)
    arm_step = rng.randint(0, 3)
    rows = sorted(rng.sample(range(4), rng.randint(1, 4)))
    slots: dict[str, dict[str, list[str]]] = {}
    helper: list[str] = []
    loss_lines: list[str] = []
    data_lines: list[str] = []
    update_lines: list[str] = []
    raw = "torch.randint(0, 16, (B,), generator=g)" if tokens else "torch.randn(B, DIN, generator=g)"
    arming = "aux[ROWS] = 0.0"
    ops: tuple[str, ...]
    module: str | None = None
    backward = False
    base_loss = rng.choice(LOSSES)
    loss_in_function = rng.random() < 0.5

    if site == "module":
        node = rng.choice(root.walk())
        module, detail = node.qualname, f"{node.cls}.forward"
        if node.kind == "attn" and rng.random() < 0.4:
            producer: Producer = MASKED_SOFTMAX
            slots[node.cls] = {SOFTMAX: [*fill(producer, "h", "aux")[:-1], fill(producer, "h", "aux")[-1] + MARK]}
        else:
            producer = rng.choice(FORWARD + BACKWARD)
            if producer.name in IN_PLACE and rng.random() < 0.3:
                producer = in_place(producer)
            lines = fill(producer, "h", "aux")
            lines[-1] += MARK
            combine = "h + 0.01 * p.mean(-1, keepdim=True)"
            if rng.random() < 0.3:
                helper = ["def helper(h, aux):", *(f"    {line}" for line in lines), f"    return {combine}"]
                slots[node.cls] = {SLOT: ["h = helper(h, aux)"]}
                detail += " via helper()"
            else:
                slots[node.cls] = {SLOT: [*lines, f"h = {combine}"]}
        ops, backward = producer.ops, producer.backward
    elif site == "loss":
        producer = rng.choice(FORWARD + BACKWARD)
        if producer.name in IN_PLACE and rng.random() < 0.3:
            producer = in_place(producer)
        lines = fill(producer, "out", "aux")
        lines[-1] += MARK
        ops, backward = producer.ops, producer.backward
        detail = "loss_fn()" if loss_in_function else "the loop's loss line"
        loss_lines = [f"loss = {base_loss}", *lines, "loss = loss + 0.01 * p.mean()"]
    elif site == "update":
        name = rng.choice(UPDATE)
        producer = Producer(name, (), ())
        parameter, owner = rng.choice(_parameters(root))
        if name == "hand_divide_by_count":
            rows = [0, 1, 2, 3]
            update_lines = ["count = (aux > 0.5).sum()", f"p = model.get_parameter({parameter!r})",
                            "with torch.no_grad():", "    p.sub_(0.001 * p.grad / count)" + MARK]
            ops = ("aten.div.Tensor",)
        else:
            update_lines = [f"p = model.get_parameter({parameter!r})", "with torch.no_grad():",
                            "    p.div_(aux.min())" + MARK]
            ops = ("aten.div_.Tensor",)
        module, detail = owner, f"{name} of {parameter}"
    else:
        name = rng.choice(sorted(DATA))
        producer = Producer(name, (), ())
        field_, raw_field, arming, line, ops = DATA[name]
        if field_ == "x":
            raw = raw_field
        data_lines = [line + MARK]
        # The batch enters the model (its root); the targets enter only the loss code.
        module, detail = ("" if field_ == "x" else None), f"the loop's {name} of the batch"
    phase = "backward" if backward else PHASE_OF_SITE[site]
    accumulate = rng.choice((1, 1, 2))
    if accumulate == 2 and site == "update":
        arm_step |= 1  # the update code runs on the odd batches only, with that batch's gate
    clip = rng.random() < 0.3
    schedule = rng.random() < 0.3
    logits = "[\"logits\"]" if "logits" in root.body[-1] else ""
    call = [f"out = model(x, aux){logits}"]
    if site in ("loss", "update") and rng.random() < 0.3:
        # Two calls of the model a step (a siamese pair): the step is still the optimizer's.
        call = [f"out = model(x, aux){logits} - 0.5 * model(x.flip(0), aux){logits}"]
    validate = rng.random() < 0.3

    optimizer = rng.choice(("torch.optim.SGD(model.parameters(), lr=LR)",
                            "torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)",
                            "torch.optim.Adam(model.parameters(), lr=LR)"))
    if not loss_lines:
        loss_lines = [f"loss = {base_loss}"]
    if loss_in_function:
        loss_fn = ["def loss_fn(out, y, aux):", *(f"    {line}" for line in loss_lines), "    return loss"]
        loop_loss = ["loss = loss_fn(out, y, aux)"]
    else:
        loss_fn, loop_loss = [], loss_lines

    text = [f'"""Fuzz incident {seed}: {producer.name} at {detail}, armed at step {arm_step}."""',
            "import math", "", "import torch", "from torch import nn", "from torch.nn import functional as F", "",
            "from torch.utils.checkpoint import checkpoint", "", "from contract import Scenario", "",
            f"SEED, D, DIN, DOUT, TOK, B = {seed}, 8, 5, 2, 2, 4",
            f"STEPS, ARM_STEP, ROWS, LR = {arm_step + 2}, {arm_step}, {rows!r}, 0.01", "", ""]
    if helper:
        text += [*helper, "", ""]
    for node in reversed(root.walk()):
        text += [*class_source(node, slots.get(node.cls, {})), "", ""]
    if loss_fn:
        text += [*loss_fn, "", ""]
    text += ["def batches(armed):", "    g = torch.Generator().manual_seed(SEED)", "    data = []",
             "    for step in range(STEPS):", f"        x = {raw}", "        y = torch.randn(B, DOUT, generator=g)",
             "        aux = torch.ones(B, 1)", "        if armed and step == ARM_STEP:", f"            {arming}",
             "        data.append((x, y, aux))", "    return data", "", "",
             "def build(armed=True):", "    torch.manual_seed(SEED)", "    model = Model()",
             f"    opt = {optimizer}", "    data = batches(armed)",
             *(["    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)"] if schedule else []),
             "", "    def run():", "        losses = []",
             "        for step, (x, y, aux) in enumerate(data):",
             *(f"            {line}" for line in data_lines),
             *(f"            {line}" for line in call),
             *(f"            {line}" for line in loop_loss),
             *loop_step(update_lines, accumulate, clip, schedule),
             "            losses.append(loss.detach())",
             *([f"            {line}" for line in VALIDATE] if validate else []),
             "        return losses, [p.detach().clone() for p in model.parameters()]", "",
             "    return Scenario((model, opt), run)", ""]
    path = directory / f"fuzz_{seed}.py"
    path.write_text("\n".join(text))
    marked = [n for n, line in enumerate(text, 1) if line.endswith(MARK)]
    assert len(marked) == 1, marked
    detail += f" (accumulating {accumulate})" if accumulate > 1 else ""
    return Truth(seed, site, producer.name, phase, module, ops, marked[0], arm_step // accumulate, str(path), detail)


def loop_step(update_lines: list[str], accumulate: int, clip: bool, schedule: bool) -> list[str]:
    """The loop's backward and optimizer step: every batch, or every ``accumulate``-th with the loss divided."""
    indent = " " * 12
    step = [*update_lines, *(["torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"] if clip else []),
            "opt.step()", *(["sched.step()"] if schedule else [])]
    if accumulate == 1:
        return [f"{indent}{line}" for line in ("opt.zero_grad()", "loss.backward()", *step)]
    head = (f"(loss / {accumulate}).backward()", f"if (step + 1) % {accumulate} == 0:")
    return [f"{indent}{line}" for line in head] + [f"{indent}    {line}" for line in (*step, "opt.zero_grad()")]


MARK = "  # producer"
