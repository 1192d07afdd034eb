"""The scalar history of one step (:class:`StepSummary`): stdlib only, below the Report that holds a run of them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepSummary"]


@dataclass(frozen=True)
class StepSummary:
    """Scalar history of one step: enough to see a slow blow-up.

    ``headroom`` is the smallest ``finfo(dtype).max / |x|`` over the step's
    module outputs (how many times larger a value could grow before it
    overflows its dtype), with the module and dtype where it was smallest;
    ``grad_headroom`` the same over the gradients flowing through the modules
    (None under a GradScaler, whose scaled gradients overflow by design).
    """

    step: int
    loss: float | None
    absmax: float | None
    grad_norm: float | None = None
    headroom: float | None = None
    headroom_module: str | None = None
    headroom_dtype: str | None = None
    grad_headroom: float | None = None
    grad_headroom_module: str | None = None
    grad_headroom_dtype: str | None = None
    input_absmax: float | None = None
    scale: float | None = None
    nonfinite: bool = False
    #: Whether the step checked every module call (the tiered watch's full-check steps, every step
    #: of ``tiered=False``): ``absmax`` and ``headroom`` then cover every module's output, else only
    #: the model's outputs.
    full: bool = False
    #: On such a step, each module's largest finite ``|output|`` and its dtype: ``(module, value, dtype, path)``
    #: (``path``: as :attr:`LayerCall.path`), in call order (empty on the other steps).
    layers: tuple[tuple[str, float, str, tuple[str, ...]], ...] = ()
