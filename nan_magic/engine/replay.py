"""Re-run one module call under op-level tracing to name the producer op.

The per-module watch finds *which module* first produced a non-finite value
at the cost of one reduction per call. To name the op and the line inside it,
the watch keeps that call's inputs and the RNG state from just before it, and
:func:`replay_module` runs the module again on them under an
:class:`~nan_magic.engine.ops.OpTracer`: same inputs, same dropout masks,
same kernels. The replay leaves no trace: it runs under ``no_grad`` on copies
of the inputs, buffers are swapped for copies during the run, a parameter
that the forward writes in place is restored bit for bit, and the RNG state
is put back to what it was before the replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from nan_magic.engine.ops import OpFinding, OpTracer
from nan_magic.engine.stats import iter_tensors, kinds_of, relevant_kinds

__all__ = ["ReplayResult", "RngState", "capture_rng_state", "replay_module", "restore_rng_state"]


@dataclass(frozen=True)
class RngState:
    """The default generators' states: CPU, and each CUDA device's if CUDA is in use."""

    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class ReplayResult:
    """What a replay found.

    Attributes
    ----------
    finding
        The producer op inside the module, or None.
    reproduced
        Whether the replay produced a non-finite value again (then
        ``finding`` is set).
    note
        Why there is no finding, in one sentence; None when there is one.
    held_by_inputs
        The replay's output was non-finite but no op inside produced it: its
        inputs, parameters, buffers or scalar arguments (``masked_fill(mask,
        -inf)``) already held that kind.
    """

    finding: OpFinding | None
    reproduced: bool
    note: str | None = None
    held_by_inputs: bool = False


def capture_rng_state() -> RngState:
    """The state of the default CPU and CUDA generators, to replay a call with.

    CUDA is only asked when it is already initialised: capturing must not
    start a CUDA context in a CPU-only program.
    """
    cuda = None
    # is_initialized first: it is a flag read, is_available() is not (hot path).
    if torch.cuda.is_initialized() and torch.cuda.is_available():
        cuda = tuple(torch.cuda.get_rng_state_all())
    return RngState(cpu=torch.get_rng_state(), cuda=cuda)


def restore_rng_state(state: RngState) -> None:
    """Set the default generators back to ``state``."""
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(list(state.cuda))


def replay_module(
    module: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    rng_state: RngState,
    kinds: frozenset[str] = frozenset({"nan", "inf"}),
    module_name: str = "",
) -> ReplayResult:
    """Run ``module(*args, **kwargs)`` again under an :class:`OpTracer`.

    Parameters
    ----------
    module
        The module whose call produced a non-finite value.
    args, kwargs
        The arguments that call received (what ``module.__call__`` got, so
        that the user's own pre-hooks see them again). They are copied first:
        a forward that works in place on its input must not change the
        user's tensors a second time.
    rng_state
        :func:`capture_rng_state` from right before the original call, so that
        dropout draws the same mask.
    kinds
        The kinds that count, as in :class:`OpTracer`.
    module_name
        Qualified name of ``module``; the finding names submodules under it
        (``"encoder.2.attn"``).

    Returns
    -------
    ReplayResult
        The producer op, or why there is none.

    Notes
    -----
    Call it where the original call ran (inside the watch's hook): autocast
    and the module's train/eval mode must be the same. The replay runs under
    ``no_grad``; a module that takes a different path without autograd (the
    fused inference path of ``nn.TransformerEncoderLayer`` in eval mode) may
    compute differently than a call that recorded a graph.
    """
    label = module_name or "the root module"
    names = {id(sub): _join(module_name, name) for name, sub in module.named_modules()}
    stack: list[str] = []
    tracer = OpTracer(
        kinds=kinds, module_name=lambda: stack[-1] if stack else None, on_finding=_stop
    )
    guard = _ParameterGuard(module.parameters())
    tracer._before_write = guard.before_write

    def enter(sub: nn.Module, _args: Any) -> None:
        name = names.get(id(sub))
        if name is not None:
            stack.append(name)

    def leave(sub: nn.Module, _args: Any, _output: Any) -> None:
        if id(sub) in names and stack:
            stack.pop()

    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        args, kwargs = _copy(tuple(args), copies), _copy(dict(kwargs), copies)
    user_rng = capture_rng_state()
    output: Any = None
    failure: Exception | None = None
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(restore_rng_state, user_rng)
        cleanup.callback(guard.restore)
        cleanup.enter_context(_swapped_buffers(module))
        cleanup.enter_context(register_module_forward_pre_hook(enter))
        cleanup.enter_context(register_module_forward_hook(leave, always_call=True))
        restore_rng_state(rng_state)
        try:
            with torch.no_grad(), tracer:
                output = module(*args, **kwargs)
        except _Stop:
            pass
        except Exception as error:
            failure = error
    if tracer.finding is not None:
        return ReplayResult(finding=tracer.finding, reproduced=True)
    if failure is not None:
        note = f"replay of {label} raised {type(failure).__name__}: {failure}; the op is unknown"
    elif any(relevant_kinds(kinds_of(t), frozenset(kinds)) for _, t in iter_tensors(output)):
        note = (
            f"replay of {label} gave a non-finite output that no op inside it produced: "
            "its inputs, parameters, buffers or scalar arguments already held it"
        )
        return ReplayResult(finding=None, reproduced=False, note=note, held_by_inputs=True)
    else:
        note = f"replay of {label} on its recorded inputs stayed finite; the op is unknown"
    return ReplayResult(finding=None, reproduced=False, note=note)


class _Stop(Exception):
    """Ends a replay at its finding: the rest of the forward is not needed."""


def _stop(_finding: OpFinding) -> None:
    raise _Stop


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _copy(value: Any, copies: dict[int, torch.Tensor]) -> Any:
    """Copy the tensors in tuples, lists and dicts; one copy per tensor object."""
    if isinstance(value, torch.Tensor):
        if id(value) not in copies:
            copies[id(value)] = value.detach().clone()
        return copies[id(value)]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_copy(item, copies) for item in value))
    if type(value) in (tuple, list):
        return type(value)(_copy(item, copies) for item in value)
    if type(value) is dict:
        return {key: _copy(item, copies) for key, item in value.items()}
    return value


@contextlib.contextmanager
def _swapped_buffers(module: nn.Module) -> Iterator[None]:
    """Give every submodule copies of its buffers for the duration.

    BatchNorm updates its running statistics during the replay; the originals
    are never touched (not even their version counters, which autograd checks
    for the user's pending backward). A buffer shared by several modules
    gets one shared copy.
    """
    copies: dict[int, torch.Tensor] = {}
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for sub in module.modules():
            for name, buffer in list(sub._buffers.items()):
                if buffer is None:
                    continue
                if id(buffer) not in copies:
                    copies[id(buffer)] = buffer.detach().clone()
                swapped.append((sub, name, buffer))
                sub._buffers[name] = copies[id(buffer)]
        yield
    finally:
        for sub, name, buffer in swapped:
            sub._buffers[name] = buffer


class _ParameterGuard:
    """Copy-on-write for parameters: restore any that the forward writes in place.

    Parameters are not copied up front (that would double a large module's
    memory); the tracer calls :meth:`before_write` ahead of every op that
    writes a tensor, and the storage of a parameter about to change is saved
    once. Restoring writes the storage back bit for bit.
    """

    def __init__(self, parameters: Iterator[nn.Parameter]) -> None:
        self._storages = {
            p.untyped_storage().data_ptr(): p.untyped_storage() for p in parameters if p.numel()
        }
        self._saved: dict[int, torch.UntypedStorage] = {}

    def before_write(self, tensor: torch.Tensor) -> None:
        if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.is_meta:
            return
        key = tensor.untyped_storage().data_ptr()
        if key in self._storages and key not in self._saved:
            self._saved[key] = self._storages[key].clone()

    def restore(self) -> None:
        for key, saved in self._saved.items():
            self._storages[key].copy_(saved)
        self._saved.clear()
