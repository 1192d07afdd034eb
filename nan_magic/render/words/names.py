"""Short labels of typed tensor references: ``output[1]``, ``parameter fc.weight``, ``self (before)``.

Stdlib only: ``str(TensorRef)`` calls it, from the records as from every view.
"""

from __future__ import annotations

from nan_magic.records import LayerCall, Sample, TensorRef, TensorRole

__all__ = ["row_tensor", "sample_label", "subject_label", "tensor_label"]


def tensor_label(ref: TensorRef) -> str:
    role = ref.role
    if role is TensorRole.INPUT and ref.name is not None:  # a value a call's own code passed to a child
        return f"{ref.path} of {ref.name}"
    if role in (TensorRole.MODULE_OUTPUT, TensorRole.INPUT):
        return ref.path
    if role is TensorRole.OP_OUTPUT:
        return f"{ref.path} of {ref.name}"
    if role is TensorRole.OPERAND:
        return f"{ref.name}{' (before)' if ref.before else ''}"
    if role is TensorRole.OUTPUT_GRADIENT:
        # No owner: the gradient of an argument as its consumer saw it; "" the model's own output.
        return f"grad of {ref.path}" if ref.name is None else f"grad of {ref.name or 'model'} {ref.path}".rstrip()
    if role is TensorRole.PARAMETER_GRADIENT:
        return f"gradient of {ref.name}"
    if role is TensorRole.OPTIMIZER_STATE:
        return f"state {ref.path} of {ref.name}"
    if role is TensorRole.LOSS:
        return "loss"
    return f"{role.value} {ref.name}"  # parameter, buffer


def subject_label(ref: TensorRef) -> str:
    """A tensor as a sentence's subject: a parameter by its name alone (``fc.weight``), any other by its label."""
    return ref.name if ref.role is TensorRole.PARAMETER and ref.name else tensor_label(ref)


def sample_label(sample: Sample) -> str:
    """A histogram's title: ``encoder.1 output``, ``(root) input[0]`` for a layer's tensor, else its label alone."""
    tensor = tensor_label(sample.tensor) if sample.tensor is not None else "values"
    return tensor if sample.module is None else f"{sample.module or '(root)'} {tensor}"


def row_tensor(layer: LayerCall) -> str:
    """A layer row's tensor column: its reference's label, or the words an older scene stored for it."""
    return tensor_label(layer.tensor) if layer.tensor is not None else layer.said or ""
