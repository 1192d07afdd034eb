"""What an optimizer step touches (its layout) and whether it can make a finite parameter non-finite.

A bounded step. Checking every parameter after every step reads all of them
once more (on the benchmark MLP, 34 MB and about 3% of a step). A step of
plain ``SGD``, ``Adam`` or ``AdamW`` on float32/float64 parameters and state,
with finite hyperparameters, a learning rate of at most 1e12 (over 1 - momentum,
momentum in [0, 1)), ``eps > 0``, betas in [0, 1) and gradients that
were just checked finite (each gradient's norm below 1e18, so its square is
finite too), computes a finite update from finite state: momentum and
moments are averages of finite gradients, and Adam divides by at least
``eps``. Such a step cannot make a parameter non-finite unless a parameter
is already within reach of the float32 maximum, so its parameter pass is
skipped; every ``FULL_CHECK_EVERY`` steps (step_checks.py), and at the first step
of a watch, the parameters are checked anyway (which also covers a parameter
written outside the optimizer). A non-finite parameter read by a module is
reported by the forward pass at the next step whatever happens here. Any
other optimizer, half-precision parameter or state, or a non-finite
gradient applied (``on_detect="warn"``) gets the full check every step, and so does
a step that runs the user's own step hooks (``opt.register_step_pre_hook``,
``register_step_post_hook``, or global ones): code inside ``opt.step()`` that can
write anything (a max-norm projection of the weights, a gradient normalisation),
whose writes the bound says nothing of.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch
from torch.optim import optimizer as optimizers

from nan_magic.records import TensorRef, TensorRole

__all__ = [
    "BOUNDED_GRAD_NORM", "BOUNDED_OPTIMIZERS", "Layout", "StepResult", "bounded_step", "global_users_hooks",
    "group_eps", "group_lr", "group_value", "largest_decay", "runs_user_hooks", "wild_hyperparameters",
]

#: Optimizers whose step is bounded by its gradients (see the module docstring).
BOUNDED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)

#: Below this per-tensor gradient norm, every squared gradient element is finite in float32.
BOUNDED_GRAD_NORM = 1e18

#: At most this learning rate (over 1 - momentum; times the weight decay too): an update of at most
#: about 1e12 x 1e18 = 1e30 cannot overflow float32 (3.4e38) by itself.
BOUNDED_LR = 1e12


@dataclass
class StepResult:
    """What one optimizer step updated, with the norms that say if it stayed finite.

    ``updated`` is the optimizer's parameters then its half-precision state
    tensors; their labels are only built for a report (:meth:`label`).
    """

    optimizer: torch.optim.Optimizer
    step: int
    layout: Layout
    updated: list[torch.Tensor]
    norms: list[torch.Tensor]
    #: The step after which the parameters were last checked before this one (None: never).
    previous_check: int | None = None
    #: The step was a bounded one, checked only because a full check was due.
    bounded: bool = False
    #: The deferred check's record of the user's line that called the step: ``(code, line, globals)``.
    caller: tuple[CodeType, int, dict[str, Any]] | None = None
    #: That line's frame (only a module's top level: step_checks) and instruction (a carried result, until the
    #: next check).
    caller_frame: FrameType | None = None
    caller_lasti: int = -1
    #: Copies taken before the step of the parameters near their dtype's limit, by id (headroom.py).
    before: dict[int, torch.Tensor] = field(default_factory=dict)
    #: The state tensors in ``updated`` after the parameters, ``(name, parameter, key)``: the layout's
    #: half-precision state, or (after gradients of BOUNDED_GRAD_NORM or more) every state tensor.
    states: list[tuple[str, torch.Tensor, Any]] = field(default_factory=list)
    #: ``norms`` is one sum over all of ``updated`` (Layout.one_sum), measured one by one where it is not finite.
    summed: bool = False
    #: A carried result's groups' ``lr`` objects as the step ran, in group order (a tensor rate the loop rebinds each
    #: step is the next step's in the group by the check that reads the result): None, read from the groups now.
    lrs: list[Any] | None = None

    def lr_of(self, tensor: torch.Tensor) -> tuple[float | None, Any]:
        """``(the learning rate as a number, the group's own object)`` of the group holding ``tensor`` as the step
        ran (group_lr, group_value). At an event only."""
        opt = self.optimizer
        if self.lrs is None or len(self.lrs) != len(opt.param_groups):
            return group_lr(opt, tensor), group_value(opt, tensor, "lr")
        index = next((n for n, group in enumerate(opt.param_groups) if any(p is tensor for p in group["params"])), 0)
        raw = self.lrs[index]
        value = raw.item() if isinstance(raw, torch.Tensor) and raw.numel() == 1 else raw
        return (float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None), raw

    def owner(self, index: int) -> tuple[torch.Tensor, str | None]:
        """The parameter behind ``updated[index]``, and the state key where it is a state tensor."""
        parameters = self.layout.named
        if index < len(parameters):
            return parameters[index][1], None
        _name, parameter, key = self.states[index - len(parameters)]
        return parameter, key

    def label(self, index: int) -> TensorRef:
        parameters = self.layout.named
        if index < len(parameters):
            return TensorRef.parameter(parameters[index][0])
        name, _parameter, key = self.states[index - len(parameters)]
        return TensorRef(TensorRole.OPTIMIZER_STATE, name, str(key))


@dataclass
class Layout:
    """An optimizer's parameters under their model names, cached between steps.

    Walking the parameter groups and the optimizer state every step costs
    Python time per parameter; the layout is rebuilt only when the parameter
    list (``signature``) or the number of parameters with state changes.
    """

    signature: tuple[int, ...]
    named: list[tuple[str, torch.Tensor]]
    #: The floating parameters with elements: those whose gradients are checked.
    floating: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: Every parameter is float32 or float64.
    wide: bool = False
    state_count: int = -1
    #: ``(name, parameter, key)`` of state tensors below 32 bits.
    half_state: list[tuple[str, torch.Tensor, str]] = field(default_factory=list)
    #: The floating parameters whose gradient norms one fused call takes, one list per (device, dtype)...
    groups: list[list[torch.Tensor]] = field(default_factory=list)
    #: ...and the large CPU ones, whose norms are taken in backward (step_checks.py's "Hot gradients").
    large: list[torch.Tensor] = field(default_factory=list)
    #: Norms taken one gradient at a time (reads.norms): a sharded parameter, a sparse gradient seen.
    generic: bool = False
    #: The small CPU gradients are few enough to be copied into one buffer for their norm (layouts.FLAT_MAX_NUMEL).
    flat_ok: bool = True
    #: Every parameter is a small CPU one, all of one wide dtype: a step's parameter check reads one sum of their
    #: concatenation, not a value per parameter (step_checks.py's _step_result).
    one_sum: bool = False
    #: bounded_step's last verdict on all but the learning rate, and the other hyperparameters it was given
    #: (plain numbers only), asked every step.
    bounded_for: list[tuple[Any, ...]] | None = None
    bounded: bool = False
    #: The running statistics the models of these parameters write, read with their gradients (running_stats.py).
    running: Any = None
    #: The first parameter's dtype: ``model.half()`` converts the parameters in place (their ids stay), and the
    #: layout's verdicts (``wide``, the groups, the bounded step) are rebuilt for the new dtype.
    dtype: Any = None
    #: The ids of ``signature`` as a set, made with the layout: the parameters a step of it stepped
    #: (the step replays' release, localize/replay/tiered/step.py), with no set built at each step.
    ids: frozenset[int] = frozenset()


def group_eps(opt: torch.optim.Optimizer, tensor: torch.Tensor) -> float | None:
    """The ``eps`` of the parameter group holding ``tensor`` (of every group, for a state tensor, where they agree)."""
    return _group_number(opt, tensor, "eps")  # Adafactor's is a pair: no single eps


def default_eps(optimizer: type) -> float | None:
    """The eps the optimizer's class defaults to (Adagrad's 1e-10, Adadelta's 1e-6, Adam's 1e-8): its own
    constructor's, else that of the first class it derives from that gives one (``WarmAdagrad(Adagrad)``, whose
    ``__init__`` takes ``**kwargs``); None where none gives a positive number. Read at an event only."""
    for cls in optimizer.__mro__:
        if "__init__" not in vars(cls) or cls is torch.optim.Optimizer:
            continue
        try:
            default = inspect.signature(vars(cls)["__init__"]).parameters["eps"].default
        except (KeyError, TypeError, ValueError):
            continue
        if isinstance(default, (int, float)) and not isinstance(default, bool) and default > 0:
            return float(default)
    return None


def group_lr(opt: torch.optim.Optimizer, tensor: torch.Tensor) -> float | None:
    """The learning rate of the parameter group holding ``tensor``, read as :func:`group_eps` reads eps."""
    return _group_number(opt, tensor, "lr")


def largest_decay(optimizers: Iterable[torch.optim.Optimizer]) -> tuple[float, float] | None:
    """``(lr, weight_decay)`` of the parameter group whose ``lr * weight_decay`` is largest; None where none decays.

    Read at an event only (a tensor lr is read to the host then). A group without both numbers is passed over.
    """
    best: tuple[float, float] | None = None
    for opt in optimizers:
        for group in getattr(opt, "param_groups", ()):
            numbers = [group.get(key) for key in ("lr", "weight_decay")]
            numbers = [value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                       for value in numbers]
            if not all(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                       for value in numbers):
                continue
            lr, decay = float(numbers[0]), float(numbers[1])
            if decay and (best is None or abs(lr * decay) > abs(best[0] * best[1])):
                best = (lr, decay)
    return best


def group_value(opt: torch.optim.Optimizer, tensor: torch.Tensor, key: str) -> Any:
    """The object ``key`` of the first parameter group holding ``tensor`` (of the first group where none holds it)."""
    groups = _groups_of(opt, tensor)
    return groups[0].get(key) if groups else None


def _groups_of(opt: torch.optim.Optimizer, tensor: torch.Tensor) -> list[dict[str, Any]]:
    return [group for group in opt.param_groups if any(p is tensor for p in group["params"])] or opt.param_groups


def _group_number(opt: torch.optim.Optimizer, tensor: torch.Tensor, key: str) -> float | None:
    groups = _groups_of(opt, tensor)
    values = []
    for group in groups:
        value = group.get(key)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()  # a tensor lr (capturable, fused): read once, at the event
        values.append(value)
    # A NaN (a schedule gone wrong) equals no value, itself included: compared as the same number here.
    value = values[0] if values and all(_same_number(other, values[0]) for other in values) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _same_number(a: Any, b: Any) -> bool:
    return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def bounded_step(opt: torch.optim.Optimizer, layout: Layout) -> bool:
    """Whether a step of ``opt`` on finite gradients keeps finite parameters finite.

    See the module docstring for the argument; this checks its conditions
    (the gradients are checked by the caller). The verdict on everything
    but the learning rate is cached while those hyperparameters stay the
    same: a schedule changes ``lr`` every step, and only its bound is then
    checked again, in a few operations a group.
    """
    if type(opt) not in BOUNDED_OPTIMIZERS or not layout.wide or layout.half_state:
        return False
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return False  # hooks of the user's run inside its step (the watch's own are seated beside them only then)
    groups = opt.param_groups
    rest = [tuple(map(group.get, _HYPERPARAMETERS)) for group in groups]
    if rest == layout.bounded_for:  # the usual step: at most the learning rate changed since the last
        if not layout.bounded:
            return False
        for group, (momentum, weight_decay, *_others) in zip(groups, rest):
            lr = group["lr"]
            if type(lr) not in _PLAIN_NUMBERS:
                break  # a tensor now: judged afresh below
            # (_lr_bounded, inlined without abs(): momentum < 1 in a cached verdict; NaN compares False)
            update, decay = lr / (1.0 - (momentum or 0.0)), lr * (weight_decay or 0.0)
            if not (-BOUNDED_LR <= update <= BOUNDED_LR and -BOUNDED_LR <= decay <= BOUNDED_LR):
                return False
        else:
            return True
    bounded = _bounded(opt)
    # A tensor (a capturable learning rate) can change in place and still compare equal: never cached.
    plain = all(type(group.get("lr")) in _PLAIN_NUMBERS for group in groups) and all(
        type(value) in _PLAIN_NUMBERS or (type(value) is tuple and all(type(item) is float for item in value))
        for values in rest for value in values)
    layout.bounded_for, layout.bounded = (rest, _bounded(opt, ignore_lr=True)) if plain else (None, False)
    return bounded


#: What :func:`_bounded` reads of a parameter group besides ``lr``; a cached verdict holds while these are the same.
_HYPERPARAMETERS = ("momentum", "weight_decay", "dampening", "eps", "betas")
_PLAIN_NUMBERS = frozenset({int, float, bool, type(None)})


def _bounded(opt: torch.optim.Optimizer, ignore_lr: bool = False) -> bool:
    """The module docstring's conditions on every group's hyperparameters (``ignore_lr``: all but the lr's bound)."""
    adam = type(opt) is not torch.optim.SGD
    for group in opt.param_groups:
        lr = 0.0 if ignore_lr else group.get("lr")
        if isinstance(lr, torch.Tensor):
            if not lr.is_cpu or lr.numel() != 1:
                return False  # reading it would synchronise with the device
            lr = lr.item()
        momentum, weight_decay = group.get("momentum", 0.0), group.get("weight_decay", 0.0)
        if not all(isinstance(number, (int, float)) for number in (lr, momentum, weight_decay)):
            return False
        lr, momentum, weight_decay = float(lr), float(momentum), float(weight_decay)  # type: ignore[arg-type]
        numbers = [weight_decay, momentum, group.get("dampening", 0.0)]
        if not (0.0 <= momentum < 1.0 and _lr_bounded(lr, momentum, weight_decay)):
            return False
        if adam:
            eps, betas = group.get("eps"), group.get("betas")
            if not isinstance(eps, float) or not eps > 1e-30 or not isinstance(betas, tuple):
                return False
            if not all(isinstance(beta, float) and 0.0 <= beta < 1.0 for beta in betas):
                return False
            numbers.append(eps)
        if not all(isinstance(number, (int, float)) and math.isfinite(number) for number in numbers):
            return False
    return True


def _lr_bounded(lr: float, momentum: float, weight_decay: float) -> bool:
    """The update is at most about lr x |gradient| / (1 - momentum), with |gradient| < BOUNDED_GRAD_NORM:
    a learning rate that makes that reach the float32 limit (lr = 1e38) is no bounded step (NaN compares False)."""
    return abs(lr) / (1.0 - momentum) <= BOUNDED_LR and abs(lr * weight_decay) <= BOUNDED_LR


def runs_user_hooks(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` runs step hooks of the user's: its own (usually none, an empty look), or global ones
    besides the watch's (looked at only where there are more than one watch's two)."""
    hooks = (*getattr(opt, "_optimizer_step_pre_hooks", {}).values(),
             *getattr(opt, "_optimizer_step_post_hooks", {}).values())
    return any_users(hooks) or (len(_GLOBAL_PRE_HOOKS) + len(_GLOBAL_POST_HOOKS) > 2 and global_users_hooks())


def global_users_hooks() -> bool:
    """Whether torch's global optimizer step hooks hold any of the user's (or a library's), besides the watch's."""
    return any_users((*_GLOBAL_PRE_HOOKS.values(), *_GLOBAL_POST_HOOKS.values()))


def any_users(hooks: tuple[Any, ...]) -> bool:
    """Whether any of ``hooks`` is not the watch's own (told by the module that defines it)."""
    return any(not getattr(hook, "__module__", "").startswith(_OURS) for hook in hooks)


#: torch's global optimizer step hooks (the watch's own are among them while it is attached: step_hooks.py).
_GLOBAL_PRE_HOOKS = optimizers._global_optimizer_pre_hooks
_GLOBAL_POST_HOOKS = optimizers._global_optimizer_post_hooks
_OURS = __name__.split(".")[0] + "."


def wild_hyperparameters(opt: torch.optim.Optimizer) -> bool:
    """Whether a group's learning rate is a float that is NaN, infinite or past :data:`BOUNDED_LR`.

    No healthy run steps so: the deferred check reads such a step's result at
    once (one more read, paid only by a run about to fail), while its
    gradients and hyperparameters are the step's, for the replay that names
    its op (a warm-up schedule's 0/0 learning rate is gone by the next step).
    A tensor learning rate is not read (that would be a host read per step).
    """
    for group in opt.param_groups:
        lr = group.get("lr")
        if isinstance(lr, float) and not abs(lr) <= BOUNDED_LR:  # NaN compares False
            return True
    return False
