"""The injected producers: source lines that make a non-finite value from finite inputs only when armed.

Each producer reads ``h`` (a finite activation, loss input or batch) and ``aux`` (the batch's ``(B, 1)`` gate: 1.0
in every row of a healthy batch, 0.0 in the armed rows), and its last line is the producer: the first op whose
inputs are all finite and whose output is not, on the armed rows only. With ``aux`` all ones every line is finite
for any finite ``h`` (the healthy twin runs the very same lines).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Producer:
    """Source lines (``{h}`` and ``{aux}`` to fill in), the last one the producer's, and the ops it may be named by.

    ``ops`` lists every aten op the report may name: for a forward producer the op itself; for a backward one the
    gradient formula's op (which one of a formula's ops is first non-finite is the formula's business).
    """

    name: str
    lines: tuple[str, ...]
    ops: tuple[str, ...]
    backward: bool = False


# Forward producers: the op's output is non-finite on the armed rows.
FORWARD = (
    Producer("log", ("u = ({h}.abs() + 1e-3) * {aux}", "p = torch.log(u)"), ("aten.log.default",)),
    Producer("div", ("n = {aux} * {h}.shape[-1]", "p = {h} / n"), ("aten.div.Tensor",)),
    Producer("sqrt", ("u = ({h} * {h} + 1) * (2 * {aux} - 1)", "p = torch.sqrt(u)"), ("aten.sqrt.default",)),
    Producer("rsqrt", ("u = ({h} * {h} + 1) * {aux}", "p = torch.rsqrt(u)"), ("aten.rsqrt.default",)),
    Producer("pow", ("u = ({h} * {h} + 1) * {aux}", "p = u.pow(-1.5)"), ("aten.pow.Tensor_Scalar",)),
    Producer("exp", ("u = {h}.clamp(-5, 5) + 200 * (1 - {aux})", "p = torch.exp(u)"), ("aten.exp.default",)),
    Producer("acos", ("u = torch.tanh({h}) * {aux} + 2 * (1 - {aux})", "p = torch.acos(u)"), ("aten.acos.default",)),
    Producer("atanh", ("u = torch.tanh({h}) * 0.5 * {aux} + (1 - {aux})", "p = torch.atanh(u)"),
             ("aten.atanh.default",)),
    Producer("lgamma", ("u = ({h}.abs() + 1) * {aux} - 2 * (1 - {aux})", "p = torch.lgamma(u)"),
             ("aten.lgamma.default",)),
    Producer("fp16", ("u = ({h}.abs() + 100).half()", "f = (1 + 999 * (1 - {aux})).half()", "p = (u * f).float()"),
             ("aten.mul.Tensor",)),
)

# Backward producers: the forward is finite on every row, the gradient formula of the last line is not.
BACKWARD = (
    Producer("sqrt_at_zero", ("u = (({h} * {aux}).pow(2) + 1e-3 * {aux}).sum(-1, keepdim=True)", "p = torch.sqrt(u)"),
             ("aten.div.Tensor",), backward=True),
    # (Neither the norm of a zero vector nor atan2 at (0, 0) is one: torch's formulas give 0 there.)
    Producer("entr_at_zero", ("u = ({h} * {aux}).pow(2) + 1e-3 * {aux}", "p = torch.special.entr(u)"),
             ("aten.log.default", "aten.mul.Tensor", "aten.neg.default", "aten.add.Tensor"), backward=True),
    Producer("asin_at_one", ("u = torch.tanh({h}) * 0.5 * {aux} + (1 - {aux})", "p = torch.asin(u)"),
             ("aten.rsqrt.default", "aten.div.Tensor", "aten.mul.Tensor"), backward=True),
    Producer("pow_fraction_at_zero", ("u = ({h} * {aux}).pow(2) + 1e-3 * {aux}", "p = u.pow(0.25)"),
             ("aten.pow.Tensor_Scalar", "aten.mul.Tensor"), backward=True),
)

# The masked-softmax producer of an attention block: its lines replace the block's softmax line.
MASKED_SOFTMAX = Producer(
    "masked_softmax",
    ("mask = ({aux} < 0.5).view(-1, 1, 1).expand_as(scores)",
     "scores = scores.masked_fill(mask, float(\"-inf\"))",
     "probs = scores.softmax(-1)"),
    ("aten._softmax.default",))


# In-place forms of forward producers (``p = torch.log(u)`` -> ``p = u.log_()``), and the op they are named by.
IN_PLACE = {"log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt", "exp": "exp", "acos": "acos",
            "lgamma": "lgamma"}


def in_place(producer: Producer) -> Producer:
    """``producer`` with its last line's function applied in place to ``u``."""
    name = IN_PLACE[producer.name]
    return Producer(f"{producer.name}_", (*producer.lines[:-1], f"p = u.{name}_()"), (f"aten.{name}_.default",))


def fill(producer: Producer, h: str, aux: str) -> list[str]:
    """The producer's lines reading ``h`` and ``aux``."""
    return [line.format(h=h, aux=aux) for line in producer.lines]
