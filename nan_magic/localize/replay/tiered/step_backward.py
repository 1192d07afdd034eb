"""The backward half of a step replay (replay/tiered/step.py): a model call's backward, run again.

The replayed call's outputs get the gradients that flowed into them in the
user's step (captured by the watch's tensor hooks), and
``torch.autograd.grad`` runs from them into scratch gradients: never
``.grad``, and no accumulate-grad hook fires (DDP's reducer stays quiet).
What the captured gradients hold needs care: a non-finite part was made
before the model's backward (:func:`_finite_part`), and an output the model
also consumed itself already holds what the model added (:func:`_outermost`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from nan_magic.distributed.ranks import data_parallel_paths, user_name
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.reads import iter_tensors, relevant_kinds
from nan_magic.hot.stats import kinds_of, tensor_stats
from nan_magic.patches.registry import ProcessPatch, Wrap
from nan_magic.records import Note, Phase, TensorRef, TensorRole, TensorStats

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nan_magic.hot.checks.forward import ForwardChecks
    from nan_magic.hot.checks.optimizer.step_checks import OptimizerChecks
    from nan_magic.hot.kept.step_log import StepLog
    from nan_magic.hot.watched.targets import Targets
    from nan_magic.localize.ops.origins import OpFinding
    from nan_magic.localize.ops.tracer import OpTracer
    from nan_magic.options import WatchConfig
    from nan_magic.records import Report

__all__ = ["ReplayOrigins", "ReplayWatch", "reentrant_checkpoints_inline", "replay_backward"]


class ReplayOrigins(Protocol):
    """What a step replay uses of its nested watch's op origins (localize/op_origins.py, a layer above)."""

    @property
    def tracer(self) -> OpTracer | None: ...

    def add_op_origin(self, finding: Finding, tensor: torch.Tensor | None, key: int | None = None) -> None: ...

    def report_op(self, op_finding: OpFinding) -> None: ...


class ReplayWatch(Protocol):
    """The nested full watch a step replay runs under (lifecycle/watch.py makes it): what the replay reads."""

    @property
    def config(self) -> WatchConfig: ...

    @property
    def origins(self) -> ReplayOrigins: ...

    @property
    def optimizers(self) -> OptimizerChecks: ...

    @property
    def forward(self) -> ForwardChecks: ...

    @property
    def report(self) -> Report | None: ...

    @property
    def log(self) -> StepLog: ...

    @property
    def targets(self) -> Targets: ...

    @property
    def events(self) -> list[Report]: ...

    @property
    def producer_frame(self) -> FrameType | None: ...

    @property
    def producer_position(self) -> tuple[int, int] | None: ...

    @property
    def producer_calls(self) -> tuple[tuple[FrameType, int, int], ...]: ...

    def emit(self, finding: Finding) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> Any: ...


def _differentiated(inner: ReplayWatch, target: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name, parameter, the replayed model's own)`` of each parameter the replay's backward differentiates: the
    model's, then those of the other watched models (the replay's watch holds them all) that its forward may call
    (a critic called inside the generator's forward, held by no attribute), each named in its own model."""
    data_parallel = data_parallel_paths(target)
    named: list[tuple[str, torch.Tensor, bool]] = [
        (user_name(name, data_parallel), p, True) for name, p in target.named_parameters() if p.requires_grad]
    seen = {id(p) for _name, p, _own in named}
    for _label, root in inner.targets.roots:
        if root is target:
            continue
        paths = data_parallel_paths(root)
        for name, p in root.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((user_name(name, paths), p, False))
    return named


def replay_backward(inner: ReplayWatch, target: nn.Module, output_grads: dict[str, torch.Tensor], output: Any,
                    boundary: TensorRef | None, inputs: list[torch.Tensor],
                    originals: dict[str, torch.Tensor] | None = None, input_paths: list[str] | None = None
                    ) -> TensorStats | None:
    """A model call's backward, replayed from its captured output gradients into scratch gradients.

    The nested watch sees the gradients flowing into each module; a
    gradient that only a parameter's own formula made non-finite (its
    weight gradient) is found among the returned gradients. ``inputs``
    are the argument copies that require gradients (differentiated too,
    so a frozen model's backward runs). Returns the stats of the
    parameter gradient named by ``boundary``. ``originals``: the call's
    outputs still alive, by path: the gradient captured is the one the
    watch's hook saw, before the user's hooks on that output ran (they were
    registered after it), so theirs run on the replay's output too. ``input_paths``: where each of ``inputs`` is in
    the call (``input[0]``), the name of a non-finite gradient that only an input gets.
    """
    for path, tensor in iter_tensors(output, "output", attributes=True):
        original = (originals or {}).get(path)
        hooks = getattr(original, "_backward_hooks", None) or {}
        for hook in list(hooks.values()):
            if tensor.requires_grad and not _ours(hook):
                tensor.register_hook(hook)
    pairs = _outermost([
        (tensor, _finite_part(output_grads[path]))
        for path, tensor in iter_tensors(output, "output", attributes=True)
        if path in output_grads and tensor.requires_grad
    ])
    named = _differentiated(inner, target)
    if not pairs or not (named or inputs):
        return None
    every = torch.autograd.grad(
        [tensor for tensor, _grad in pairs], [*(p for _name, p, _own in named), *inputs],
        grad_outputs=[grad for _tensor, grad in pairs], allow_unused=True,
    )
    grads = every[: len(named)]
    found = None
    for (name, parameter, own), grad in zip(reversed(named), reversed(grads)):
        if grad is None or not relevant_kinds(kinds_of(grad), inner.config.kinds):
            continue
        if own and TensorRef.gradient(name) == boundary:
            found = tensor_stats(grad)
        if inner.report is None:
            finding = Finding(Phase.BACKWARD, None, TensorRef.gradient(name), bad=grad.detach())
            finding.notes.append(Note("own-gradient-formula"))
            inner.optimizers.reports.attribute(finding, None if own else parameter)
            inner.origins.add_op_origin(finding, grad)
            inner.emit(finding)
    if inner.report is None:
        # No module boundary and no parameter saw it: a gradient the model's own formula made non-finite on its way
        # to an argument only (a PINN's ``autograd.grad(u, x)`` through ``sqrt(x . x)`` at the origin).
        for index, grad in enumerate(every[len(named):]):
            if grad is not None and relevant_kinds(kinds_of(grad), inner.config.kinds):
                path = input_paths[index] if input_paths is not None else f"input[{index}]"
                finding = Finding(Phase.BACKWARD, None, TensorRef(TensorRole.OUTPUT_GRADIENT, None, path),
                                  bad=grad.detach())
                inner.origins.add_op_origin(finding, grad)
                inner.emit(finding)
                break
    return found


def _ours(hook: Any) -> bool:
    """Whether a tensor hook is the watch's (a partial of its gradient check), not the user's."""
    return getattr(getattr(hook, "func", hook), "__module__", "").startswith("nan_magic.")


# The patch of CheckpointFunction.apply is the process's while any replay runs (patches.py counts the
# replays under a lock); only the threads running a replay take the inline path (a DataParallel replica's
# checkpoint meanwhile is left alone).
_inline_here = threading.local()


def _inline_in_replays(apply: Callable[..., Any]) -> Callable[..., Any]:
    def apply_or_inline(run_function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        if getattr(_inline_here, "depth", 0):
            return run_function(*args)
        return apply(run_function, preserve_rng_state, *args)

    return apply_or_inline


def _checkpoint_plan() -> list[tuple[Any, str, Wrap]]:
    function = getattr(torch.utils.checkpoint, "CheckpointFunction", None)
    return [] if function is None else [(function, "apply", _inline_in_replays)]


_CHECKPOINT_PATCH = ProcessPatch(_checkpoint_plan)


@contextlib.contextmanager
def reentrant_checkpoints_inline() -> Iterator[None]:
    """Run ``checkpoint(..., use_reentrant=True)`` blocks as plain calls while a backward replay runs.

    The reentrant form refuses ``torch.autograd.grad`` (the replay's scratch
    gradients), and builds its graph only inside backward, where the replay's
    forward hooks and op tracer would not see the block's modules and lines.
    Inlined, the block runs the same ops on the same draws (the replay set the
    generators), with its graph kept: only the memory that checkpointing saves
    is spent, once, for the failing call. The class is patched while any
    thread replays, and only a replaying thread takes the inline path.
    """
    with _CHECKPOINT_PATCH.held():
        _inline_here.depth = getattr(_inline_here, "depth", 0) + 1
        try:
            yield
        finally:
            _inline_here.depth -= 1


def _finite_part(grad: torch.Tensor) -> torch.Tensor:
    """A captured output gradient with its non-finite elements zeroed.

    A non-finite gradient flowing into a model's output was made before the
    model's backward (by the loss, or another model), or is the total of an
    output the model also consumed itself (an HF ``output_hidden_states``),
    whose hook sees what the model's own layers added. Fed to the replay as
    it is, the model's first module would seem to make it; zeroed, the replay
    finds only what the model's backward makes from the finite rest.
    """
    if not kinds_of(grad):
        return grad
    return torch.where(torch.isfinite(grad), grad, torch.zeros((), dtype=grad.dtype, device=grad.device))


def _outermost(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The outputs whose captured gradients a backward replay starts from: none another output was made from.

    A model that computes its loss inside (``{"loss": ..., "logits": ...}``, Hugging Face with ``labels``)
    returns the logits and a loss made from them. The gradient captured on the logits is their whole
    gradient, the loss's contribution included: starting from both would count it twice (an fp16 gradient
    that overflows only in the replay). The logits are left out; a gradient the user's own code added to
    them outside the model is then missing, and a replay that differs says so (not reproduced).
    """
    if len(pairs) < 2:
        return pairs
    made_from: set[Any] = set()
    for tensor, _grad in pairs:
        made_from |= _ancestors(tensor.grad_fn)
    return [(tensor, grad) for tensor, grad in pairs if tensor.grad_fn not in made_from]


def _ancestors(node: Any) -> set[Any]:
    """Every autograd node ``node`` reaches backward, itself excluded."""
    seen: set[Any] = set()
    stack = [parent for parent, _index in getattr(node, "next_functions", ()) if parent is not None]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(parent for parent, _index in current.next_functions if parent is not None)
    return seen
