"""Typed references to tensors: which tensor a fact is about, by role, name and path.

A :class:`~nan_magic.Report` names the tensor that went bad, the producer's
inputs and its samples with these, never with a label to parse back.
Stdlib only; :mod:`nan_magic.records` re-exports them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import overload

__all__ = ["LOSS", "OUTPUT", "TensorRef", "TensorRole", "install_labeler", "op_function"]


class TensorRole(str, enum.Enum):
    """What a reported tensor is to the program (PRODUCT.md: a typed reference)."""

    #: A module call's output; ``path`` is where in it (``"output"``, ``"output[1]"``).
    MODULE_OUTPUT = "module output"
    #: An argument of a module call, the batch for the root; ``path`` is ``"input[0]"`` or ``"kwargs['mask']"``
    #: (or how the loss code held it). With ``name``, the argument a call's own code passed to its child ``name``,
    #: or data the loss code read: ``path`` the argument of the forward op ``name`` that read it (``"weight"`` of
    #: ``"aten.nll_loss_forward.default"``), by the records or the op tracer, else of the autograd node that saved it.
    INPUT = "input"
    #: An op's output; ``name`` is the op (``"aten.div.Tensor"``), ``path`` which output (``"output"``, ``"self[0]"``).
    OP_OUTPUT = "op output"
    #: An op's tensor argument; ``name`` is its schema name (``"self"``, ``"mat2"``, ``"tensors[1]"``);
    #: ``before`` marks an in-place op's value before the op.
    OPERAND = "operand"
    #: The gradient flowing into a module output; ``name`` the module that made the tensor (``""``: the
    #: model, or no module), ``path`` the tensor within it; with ``name`` None, ``path`` is the argument of
    #: the module call that consumed it (``"input[0]"``).
    OUTPUT_GRADIENT = "output gradient"
    #: A parameter's gradient; ``name`` is the parameter's qualified name.
    PARAMETER_GRADIENT = "parameter gradient"
    #: ``name`` is the parameter's qualified name.
    PARAMETER = "parameter"
    #: A module's buffer; ``name`` is its qualified name.
    BUFFER = "buffer"
    #: An optimizer's state tensor; ``name`` is its parameter's qualified name, ``path`` the state key.
    OPTIMIZER_STATE = "optimizer state"
    #: The loss the step's backward started from.
    LOSS = "loss"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TensorRef:
    """Which tensor a fact is about: a role, a name and a path, never a sentence.

    ``str(ref)`` is its short label (``output[1]``, ``parameter fc.weight``),
    written by :func:`nan_magic.render.words.names.tensor_label`.
    """

    role: TensorRole
    name: str | None = None
    path: str = ""
    before: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", TensorRole(self.role))

    @classmethod
    def output(cls, path: str = "output") -> TensorRef:
        return cls(TensorRole.MODULE_OUTPUT, path=path or "output")

    @classmethod
    def argument(cls, path: str) -> TensorRef:
        """An argument of a module call (the batch for the root): ``input[0]``, ``kwargs['mask']``."""
        return cls(TensorRole.INPUT, path=path)

    @classmethod
    def op_output(cls, op: str, path: str = "output") -> TensorRef:
        return cls(TensorRole.OP_OUTPUT, op, path)

    @classmethod
    def parameter(cls, name: str) -> TensorRef:
        return cls(TensorRole.PARAMETER, name)

    @classmethod
    def gradient(cls, parameter: str) -> TensorRef:
        return cls(TensorRole.PARAMETER_GRADIENT, parameter)

    @property
    def is_argument(self) -> bool:
        """Whether this is an argument of a module call (``input[0]``), not an op's operand."""
        return self.role is TensorRole.INPUT

    def __str__(self) -> str:
        return _labeler[0](self)


#: The loss, as every report names it.
LOSS = TensorRef(TensorRole.LOSS)
#: A module's whole output, the tensor a report names by default.
OUTPUT = TensorRef(TensorRole.MODULE_OUTPUT, path="output")


#: Writes a reference's label: render/words/names.py's ``tensor_label``, which ``nan_magic/__init__.py``
#: installs on import (render/ sits above the records and may not be imported from here).
_labeler: list[Callable[[TensorRef], str]] = []


def install_labeler(labeler: Callable[[TensorRef], str]) -> None:
    """Label every TensorRef with ``labeler`` (its ``str``)."""
    _labeler[:] = [labeler]


@overload
def op_function(op: str) -> str: ...


@overload
def op_function(op: None) -> None: ...


def op_function(op: str | None) -> str | None:
    """The function an op is for: ``"aten._softmax.default"`` -> ``"softmax"``, ``"aten.div_.Tensor"`` -> ``"div"``.

    ``op`` is torch's own name of an OpOverload (``namespace.name.overload``,
    PRODUCT.md's ``Report.op``); the report keeps no torch object, so its
    middle part is read here, the one place that reads it.
    """
    if op is None:
        return None
    parts = op.split(".")
    return (parts[1] if len(parts) > 1 else parts[0]).strip("_")
