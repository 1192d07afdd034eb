"""The watchers nan_magic is compared against, each as a context manager over a model.

- :func:`naive_isnan_hooks`: what people write first: a forward hook on every module
  that checks each tensor output with ``torch.isnan(out).any().item()``, one host
  synchronisation per output tensor.
- :func:`debug_underflow_overflow`: the per-module work of Hugging Face's
  ``transformers.debug_utils.DebugUnderflowOverflow``, reproduced here so the benchmark
  needs no ``transformers`` and the hooks can be removed (the original never removes
  them). For every module call it formats ``abs().min()``/``abs().max()`` of each direct
  parameter, each input and each output into a text frame kept in a 21-frame ring buffer,
  and checks each of those tensors with ``isnan().any().item()`` and
  ``isinf().any().item()``, exactly as the original does (under autograd, no ``no_grad``).
- :func:`anomaly_detection`: ``torch.autograd.set_detect_anomaly(True)``, which records
  a Python stack for every autograd node in forward and checks every gradient in backward
  for NaN.
- :func:`boundary_floor`: a yardstick for the tiered default: the reads its tier 1 makes
  (the batch, the model's output, the gradient into it, every parameter gradient's norm),
  with almost no Python around them.
- :func:`checks_floor`: not a watcher but a yardstick: the reads nan_magic's per-module
  checks (``mode="full"``) make (one ``aminmax`` per module output, one ``sum`` per output gradient, one
  norm per parameter gradient), with almost no Python around them. What nan_magic costs
  beyond it is its bookkeeping (records, replays, reports, warnings).
- :func:`naive_dispatch_checker`: the op-level checker people write first, the yardstick
  for ``ops=True``: a ``TorchDispatchMode`` that checks every floating output of every
  op (forward, backward and optimizer) with ``torch.isfinite(t).all().item()``, one host
  synchronisation per op output.

Only the dispatch checker sees the optimizer step; the others are forward-only or
autograd-global.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor in a (possibly nested) tuple/list/dict module output."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


@contextlib.contextmanager
def naive_isnan_hooks(model: nn.Module) -> Iterator[None]:
    """Check every module output with ``torch.isnan(t).any().item()`` while active.

    Raises
    ------
    FloatingPointError
        From the forward hook of the first module whose output holds a NaN.
    """
    names = {module: name for name, module in model.named_modules()}

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for tensor in _tensors(output):
            if tensor.is_floating_point() and torch.isnan(tensor).any().item():
                raise FloatingPointError(f"NaN in the output of {names[module]!r}")

    handles = [module.register_forward_hook(hook) for module in model.modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class DebugUnderflowOverflow:
    """Per-module abs-min/abs-max frames, as ``transformers``' ``DebugUnderflowOverflow``.

    Parameters
    ----------
    model:
        Every module in ``model.modules()`` gets a forward hook.
    max_frames_to_save:
        Length of the ring buffer of text frames (21 in the original).
    """

    def __init__(self, model: nn.Module, max_frames_to_save: int = 21) -> None:
        self.model = model
        self.module_names = {module: name for name, module in model.named_modules()}
        self.frames: collections.deque[str] = collections.deque(maxlen=max_frames_to_save)
        self.frame: list[str] = []
        self.batch_number = 0
        self.detected_overflow = False

    def _analyse_variable(self, var: Any, ctx: str) -> None:
        if torch.is_tensor(var):
            # Formatting a 0-dim tensor calls .item(): one sync each for min and max.
            abs_var = var.abs()
            self.frame.append(f"{abs_var.min():8.2e} {abs_var.max():8.2e} {ctx}")
            if torch.isnan(var).any().item() or torch.isinf(var).any().item():
                self.detected_overflow = True
        elif var is None:
            self.frame.append(f"{'None':>17} {ctx}")
        else:
            self.frame.append(f"{'not a tensor':>17} {ctx}")

    def _forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if module is self.model:
            self.batch_number += 1
        self.frame.append(f"{self.module_names[module]} {module.__class__.__name__}")
        for name, param in module.named_parameters(recurse=False):
            self._analyse_variable(param, name)
        for i, arg in enumerate(args):
            self._analyse_variable(arg, f"input[{i}]")
        outputs = output if isinstance(output, tuple) else (output,)
        for i, out in enumerate(outputs):
            if isinstance(out, tuple):
                for j, inner in enumerate(out):
                    self._analyse_variable(inner, f"output[{i}][{j}]")
            else:
                self._analyse_variable(out, f"output[{i}]")
        self.frames.append("\n".join(self.frame))
        self.frame = []
        if self.detected_overflow:
            raise FloatingPointError(
                f"inf/nan detected during batch_number={self.batch_number}:\n" + "\n".join(self.frames)
            )

    @contextlib.contextmanager
    def attached(self) -> Iterator[DebugUnderflowOverflow]:
        """Hook every module while the ``with`` block runs, then remove the hooks."""
        handles = [m.register_forward_hook(self._forward_hook) for m in self.model.modules()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


@contextlib.contextmanager
def debug_underflow_overflow(model: nn.Module) -> Iterator[DebugUnderflowOverflow]:
    """Attach a :class:`DebugUnderflowOverflow` to ``model`` for the ``with`` block."""
    with DebugUnderflowOverflow(model).attached() as debug:
        yield debug


@contextlib.contextmanager
def anomaly_detection(model: nn.Module) -> Iterator[None]:
    """Enable autograd anomaly detection (with NaN checks) for the ``with`` block.

    ``model`` is unused: anomaly mode is global. It is taken so that every watcher
    has the same signature.
    """
    # set_detect_anomaly rather than detect_anomaly: the latter warns on every entry.
    with torch.autograd.set_detect_anomaly(True, check_nan=True):
        yield


@contextlib.contextmanager
def checks_floor(model: nn.Module) -> Iterator[None]:
    """The reads of nan_magic's per-module checks (``mode="full"``) with almost no Python: their least cost.

    Every module output gets one ``aminmax`` read on the host and a gradient hook
    that reads its gradient's ``sum``; every large CPU float parameter gets a
    post-accumulate-grad hook taking its gradient's norm by a dot while it is in
    cache; before an optimizer step the other gradients' norms come from one
    ``_foreach_norm`` and every norm is read, in one read. These are nan_magic's reads, except
    that nan_magic skips the outputs of activations whose input it knows finite.
    It names nothing and keeps nothing: a yardstick, not a watcher.

    Raises
    ------
    FloatingPointError
        At the first non-finite module output, output gradient or parameter gradient.
    """
    watched = {id(module) for module in model.modules()}

    def check_gradient(grad: torch.Tensor) -> None:
        if not math.isfinite(float(grad.detach().sum())):
            raise FloatingPointError("a non-finite output gradient")

    def check_output(module: nn.Module, args: Any, output: Any) -> None:
        if id(module) not in watched:
            return
        for tensor in _tensors(output):
            if tensor.is_floating_point() and tensor.numel():
                low, high = torch.aminmax(tensor.detach())
                if not (math.isfinite(low.item()) and math.isfinite(high.item())):
                    raise FloatingPointError("a non-finite module output")
                if tensor.grad_fn is not None:
                    tensor.register_hook(check_gradient)

    handles = [register_module_forward_hook(check_output), *_gradient_norm_hooks(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def boundary_floor(model: nn.Module) -> Iterator[None]:
    """The reads of nan_magic's tiered default (tier 1) with almost no Python: what they cost at the least.

    Only the step's boundaries, as the tiered watch checks them: one ``aminmax``
    of the batch entering the model and of its output, read on the host; the
    ``sum`` of the gradient flowing into the output; the norm of every parameter
    gradient (a dot in backward for the large CPU ones, one ``_foreach_norm`` for
    the rest), all read before the optimizer step. No records, no replay
    material, no loss recorder: what the tiered watch costs beyond this is its
    bookkeeping.

    Raises
    ------
    FloatingPointError
        At the first non-finite batch, output, output gradient or parameter gradient.
    """
    def finite(tensor: torch.Tensor) -> bool:
        low, high = torch.aminmax(tensor.detach())
        return math.isfinite(low.item()) and math.isfinite(high.item())

    def check_gradient(grad: torch.Tensor) -> None:
        if not math.isfinite(float(grad.detach().sum())):
            raise FloatingPointError("a non-finite output gradient")

    def check_batch(module: nn.Module, args: Any) -> None:
        if not all(finite(tensor) for tensor in _tensors(args) if tensor.is_floating_point() and tensor.numel()):
            raise FloatingPointError("a non-finite batch")

    def check_output(module: nn.Module, args: Any, output: Any) -> None:
        for tensor in _tensors(output):
            if tensor.is_floating_point() and tensor.numel():
                if not finite(tensor):
                    raise FloatingPointError("a non-finite model output")
                if tensor.grad_fn is not None:
                    tensor.register_hook(check_gradient)

    handles = [
        model.register_forward_pre_hook(check_batch), model.register_forward_hook(check_output),
        *_gradient_norm_hooks(model),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _gradient_norm_hooks(model: nn.Module) -> list[Any]:
    """Every parameter gradient's norm, all read at once before each optimizer step (both floors share it).

    As nan_magic takes them: a large CPU float gradient by a dot as soon as it
    is accumulated (still in cache), the others by one ``_foreach_norm``.
    Returns the hooks' handles.
    """
    hot: dict[int, torch.Tensor] = {}

    def take_norm(parameter: torch.Tensor) -> None:
        grad = parameter.grad
        if grad is not None and grad.is_contiguous():
            flat = grad.detach().view(-1)
            hot[id(parameter)] = torch.dot(flat, flat).sqrt_()

    def check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        cold = [p.grad for group in optimizer.param_groups for p in group["params"]
                if p.grad is not None and id(p) not in hot]
        norms = [*hot.values(), *(torch._foreach_norm(cold, 2) if cold else [])]
        hot.clear()
        if norms and not math.isfinite(float(torch.stack(norms).sum())):
            raise FloatingPointError("a non-finite parameter gradient")

    return [register_optimizer_step_pre_hook(check_step)] + [
        parameter.register_post_accumulate_grad_hook(take_norm)
        for parameter in model.parameters()
        if parameter.requires_grad and parameter.is_cpu and parameter.dtype in (torch.float32, torch.float64)
        and parameter.numel() >= 1 << 15
    ]


class _FiniteEveryOp(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.flagged: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            if tensor.is_floating_point() and tensor.numel() and not torch.isfinite(tensor).all().item():
                self.flagged.append(str(func))
        return out


@contextlib.contextmanager
def naive_dispatch_checker(model: nn.Module) -> Iterator[None]:
    """Check every op's floating outputs with ``isfinite().all().item()`` while active.

    It records the ops it flags instead of raising: it cannot tell GPT-2's deliberate
    ``masked_fill(-inf)`` causal mask from a fault, and a raise would end the benchmark.
    """
    with _FiniteEveryOp():
        yield
