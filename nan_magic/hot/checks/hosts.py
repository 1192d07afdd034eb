"""What the hot path's checkers read of the watch that built them, and call of the localizer.

The checkers (forward.py, gradient_checks.py, step_checks.py, step_cycle.py) sit below
the localizer and the watch (lifecycle/watch.py), which builds them: they
name what they use of those upper layers with the Protocols here, defined
at their own level, and the watch passes itself and the localizer's objects
down. Each Protocol lists only what its checker reads; mypy checks that the
watch and the localizer's classes provide it.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from nan_magic.errors.exceptions import NonFiniteError
from nan_magic.hot.checks.early import EarlyWarnings
from nan_magic.hot.kept.call_records import Alias, Call, Frame, TensorRecord
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.kept.rng import RngState
from nan_magic.hot.kept.step_log import StepLog
from nan_magic.hot.watched.coverage import Coverage
from nan_magic.hot.watched.module_hooks import GlobalModuleHooks
from nan_magic.hot.watched.owner import HookOwner
from nan_magic.hot.watched.targets import ModuleInfo, Targets
from nan_magic.options import WatchConfig
from nan_magic.records import EarlyWarning, Note, SourcePointer, TensorRef

__all__ = [
    "CallReplayer", "CodeRecorder", "ForwardHost", "GradientHost", "LossCodeReads", "OpTracing", "OptimizerHost",
    "OriginFinder", "ProducerJudge", "StepBoundaries", "StepReplayer", "WhenJudged",
]

T = TypeVar("T")


# -- the localizer, as the hot path calls it ----------------------------------------------


class KnownValues(Protocol):
    """The op tracer's :class:`~nan_magic.localize.ops.kinds.KnownKinds`, as the loss code's data check reads it."""

    def get(self, tensor: torch.Tensor) -> frozenset[str] | None: ...


class NodeOrigins(Protocol):
    """The op tracer's :class:`~nan_magic.localize.ops.sources.NodeSources`, as the loss code's data check reads it."""

    def forward_op(self, node: Any) -> tuple[str | None, SourcePointer | None]:
        """The traced forward op that made autograd node ``node``, and its line (None, None: not traced)."""


class OpTracing(Protocol):
    """The op tracer of ``ops=True`` (localize/ops/tracer.py): re-armed at each step."""

    def reset(self, origins: bool = True, keep: Sequence[torch.Tensor] = ()) -> None: ...

    def gradient_recorded(self, grad: torch.Tensor) -> None:
        """The watch recorded a module output's gradient (the deferred tracer keeps its counts)."""

    @property
    def known(self) -> KnownValues:
        """The tensors whose values this trace looked at, as they are now (an op's input or checked output)."""

    @property
    def node_sources(self) -> NodeOrigins:
        """The forward ops and lines of the autograd nodes this trace created."""

    @property
    def entered_data(self) -> Sequence[Entered]:
        """This step's non-finite tensors from outside the trace that its forward ops read into non-finite outputs."""


class OriginFinder(Protocol):
    """Names the op that started a boundary's non-finite value (localize/op_origins.py)."""

    @property
    def tracer(self) -> OpTracing | None: ...

    def add_op_origin(self, finding: Finding, tensor: torch.Tensor | None, key: int | None = None) -> None: ...

    def birth_order(self, tensor: torch.Tensor, name: str = "") -> tuple[int, bool]: ...

    def add_lr_origin(self, finding: Finding, lr: float, raw: object = None) -> bool: ...

    def made_by_recorded_code(self, tensor: torch.Tensor | None, freed: weakref.ref[torch.Tensor] | None = None
                              ) -> bool: ...

    def made_deliberately_by_recorded_code(self, tensor: torch.Tensor) -> bool: ...

    def claim_loss_backward(self, finding: Finding, loss: torch.Tensor | None, key: int | None) -> bool: ...

    def explain_failure(self, error: BaseException) -> Finding | None: ...

    def anomaly_finding(self) -> Finding | None: ...


class CodeRecorder(Protocol):
    """Records the code between the model calls (localize/outside/recorder.py), switched at the step's boundaries."""

    #: Whether it is on the dispatch stack now (recording, or inert under a mode entered since).
    pushed: bool
    #: The regions that went over their budget, not recorded again.
    untraced: set[str]

    def start(self, region: str, entry: bool = False, goes_on: Callable[[], bool] | None = None) -> None: ...

    def stop(self) -> None: ...

    def step_aside(self) -> bool: ...

    def step_back(self) -> None: ...

    def data_mark(self) -> tuple[bool, bool, int]: ...

    def data_after_hooks(self, mark: tuple[bool, bool, int], keep: bool, aside: bool) -> None: ...

    def forget(self, last: bool = False, stepping: bool = False, others: bool = False) -> None: ...

    def batch_entered(self, goes_on: Callable[[], bool] | None = None) -> None: ...

    def weaken(self) -> None: ...

    def made(self, tensor: torch.Tensor) -> bool: ...


class StepReplayer(Protocol):
    """Keeps what a replay of the step's top-level calls needs (localize/replay/tiered/step.py)."""

    def begin(self, module: nn.Module, info: ModuleInfo, call: Call, args: tuple[Any, ...],
              checkable: bool | None = None) -> RngState: ...

    def finish(self, module: nn.Module, kwargs: dict[str, Any], output: Any = None) -> None: ...

    def capture_gradient(self, call: Call, path: str, grad: torch.Tensor) -> None: ...

    def new_step(self, training: bool) -> None: ...

    def release_stepped(self, opt: torch.optim.Optimizer, ids: frozenset[int] | None = None) -> None: ...


class CallReplayer(Protocol):
    """Whether module calls keep their arguments for a replay (localize/replay/producer_call.py)."""

    @property
    def can_replay(self) -> bool: ...

    @property
    def keeps_calls(self) -> bool: ...

    @property
    def replays_kept(self) -> bool: ...

    @property
    def replays_running(self) -> bool: ...

    def classify(self, tensor: torch.Tensor) -> tuple[TensorRecord | Alias | None, bool]: ...


class ProducerJudge(Protocol):
    """The producer rule (localize/producer.py), run on each checked module output."""

    def judge(
        self,
        call: Call,
        record: TensorRecord,
        detected_at: Note | None = None,
        replay: tuple[Frame, tuple[Any, ...], dict[str, Any]] | None = None,
    ) -> None: ...

    def take_as_deliberate(self, tensor: torch.Tensor) -> None:
        """``tensor``'s infinities are a deliberate mask where they enter (a step replay's copy of another watched
        model's masked output)."""


#: A tensor the loss code read: its reference, the tensor, the line that read it (localize/outside/entering.py).
Entered = tuple[TensorRef, torch.Tensor, SourcePointer | None]


@dataclass(frozen=True)
class LossCodeReads:
    """The localizer's reads of the loss code's inputs that the gradient checks make (localize/outside/entering.py)."""

    #: The data leaves the loss code's autograd nodes saved, held weakly (taken as backward starts).
    #: With the op tracer's NodeOrigin (ops=True), each named by the forward op that made its node, with its line.
    saved_leaves: Callable[[list[Any], Any], list[tuple[TensorRef, weakref.ref[torch.Tensor], SourcePointer | None]]]
    #: The data leaves the recorded loss code read, up to the op that returned the loss (by its id then);
    #: each with the line of the op that read it; None where no recorded op returned it (not recorded).
    recorded_leaves: Callable[[int], list[Entered] | None]
    #: Whether the recorded loss code (by the loss's id) is all of it: ``(key, seen)``.
    recorded_in_full: Callable[[int, Callable[[torch.Tensor], bool]], bool]
    #: Whether the loss code ran over the recorder's budget (what it read is then known only by what it saved).
    unrecorded: Callable[[], bool]
    #: Non-finite data tensors the loss code read: ``(loss, boundary, seen, saved_before, read_all, node_origin)``.
    entering_tensors: Callable[
        [torch.Tensor | None, int, Callable[[torch.Tensor], bool], list[Entered], bool, Any], list[Entered],
    ]


# -- the watch, as its checkers read it ------------------------------------------------------


class StepBoundaries(Protocol):
    """The step cycle (step_cycle.py), as the forward and optimizer checks use it."""

    @property
    def step(self) -> int: ...

    @property
    def full_step(self) -> bool: ...

    @property
    def coverage(self) -> Coverage: ...

    @property
    def early(self) -> EarlyWarnings: ...

    trains: bool
    #: The last top-level call was a training loop's validation call (forward.py): data code runs after it.
    validated: bool
    #: The tensors over the step's numpy batches (forward.py's record_data), released as the step ends.
    batch_arrays: list[torch.Tensor]

    def training(self) -> bool: ...

    def optimized(self, module: nn.Module) -> bool: ...

    def forward_started(self, module: nn.Module, entering: Sequence[torch.Tensor] = ()) -> None: ...

    def warn(self, early: list[EarlyWarning]) -> None: ...

    def sync(
        self, extra: list[torch.Tensor] | None = None, first: Callable[[list[float]], None] | None = None
    ) -> list[float]: ...

    def check_peers(self) -> None: ...

    def end_step(self, step: int) -> None: ...

    def step_skipped(self, optimizer: torch.optim.Optimizer) -> None: ...


class WhenJudged(Protocol):
    """When values are read and judged: the watch's mode, hot/timing.py's ``Immediate`` or ``Deferred``.

    (``cycle`` and ``gradients`` are the step cycle and the gradient checks, above or beside this module.)
    """

    #: What is judging the step's values now (hot/timing.py): ``"check"``, ``"model-return"``, or None.
    judging: str | None

    @property
    def measures_in_backward(self) -> bool: ...

    @property
    def deferred(self) -> bool: ...

    def now(self, judge: Callable[..., None], *args: Any) -> None: ...

    def finite_by_sum(self, tensor: torch.Tensor, known: bool) -> bool: ...

    def free_read(self, read: Callable[[], T]) -> T | None: ...

    def check(self, cycle: Any, extra: list[torch.Tensor], first: Callable[[list[float]], None] | None
              ) -> list[float]: ...

    def update_code_ended(self, cycle: Any, written: list[torch.Tensor], by_a_call: bool) -> bool: ...

    def loss_logged(self, gradients: Any, call: Call, loss: torch.Tensor) -> None: ...

    def step_judged(self, outside: CodeRecorder) -> None: ...

    def carries_step_result(self, bounded: bool, wild: Callable[[], bool]) -> bool: ...

    def pending_at_exit(self, cycle: Any) -> NonFiniteError | None: ...


class _Checker(Protocol):
    """What every checker reads of its watch."""

    @property
    def config(self) -> WatchConfig: ...

    @property
    def timing(self) -> WhenJudged: ...

    @property
    def here(self) -> HookOwner: ...

    def emit(self, finding: Finding) -> None: ...


class ForwardHost(_Checker, Protocol):
    """What the forward checks (forward.py) read of their watch."""

    @property
    def log(self) -> StepLog: ...

    @property
    def cycle(self) -> StepBoundaries: ...

    @property
    def graph_task(self) -> int: ...

    @property
    def module_hooks(self) -> GlobalModuleHooks: ...

    @property
    def origins(self) -> OriginFinder: ...

    @property
    def outside(self) -> CodeRecorder | None: ...

    @property
    def replays(self) -> StepReplayer | None: ...

    @property
    def replay_of(self) -> object | None: ...

    @property
    def skipped(self) -> Counter[str]: ...

    @property
    def targets(self) -> Targets: ...

    def module_info(self, module: nn.Module) -> ModuleInfo | None: ...

    def on_forward_failed(self, module: nn.Module, call: Any) -> None: ...


class GradientHost(_Checker, Protocol):
    """What the gradient checks (gradient_checks.py) read of their watch."""

    @property
    def log(self) -> StepLog: ...

    @property
    def outside(self) -> CodeRecorder | None: ...

    @property
    def replays(self) -> StepReplayer | None: ...

    def listening(self) -> bool: ...

    def on_gradient_event(self, finding: Finding) -> None: ...

    def on_loss_event(self, finding: Finding, loss: torch.Tensor | None) -> None: ...


class _Stopped(Protocol):
    @property
    def stopped(self) -> bool: ...


class _Kept(Protocol):
    @property
    def where(self) -> str | None: ...

    def promote(self) -> None: ...


class OptimizerHost(_Checker, Protocol):
    """What the optimizer checks (step_checks.py) read of their watch."""

    @property
    def targets(self) -> Targets: ...

    @property
    def cycle(self) -> StepBoundaries: ...

    @property
    def outcome(self) -> _Stopped: ...

    @property
    def last_good(self) -> _Kept: ...

    def listening(self) -> bool: ...

    def on_finite_step(self) -> None: ...

    def on_step_to_judge(self) -> None: ...

    def on_step_ran(self, held: Finding | None) -> None: ...
