"""What History says of the layers inside the model, from the per-module steps' magnitudes."""

from __future__ import annotations

from nan_magic.records import StepSummary, module_label
from nan_magic.render.common import FINITE_LIMITS, finite_limit, fmt_number
from nan_magic.render.layer_tree import inside

__all__ = ["TOP_LAYERS", "layer_magnitude_lines"]


#: A per-module step's layer: ``(module, largest finite |output|, dtype, path)`` (:attr:`StepSummary.layers`).
_Layer = tuple[str, float, str, tuple[str, ...]]

#: Layers listed per per-module step in History: the closest to overflowing.
TOP_LAYERS = 5


def layer_magnitude_lines(history: tuple[StepSummary, ...], producer: str | None) -> list[str]:
    """What the last per-module step measured inside the model: its largest layer outputs, and the producer's.

    ``"step 1 (per-module: every module's output measured): blocks.0.attn.qkv max |output| 516, headroom 127x
    (float16)"``; the model outputs alone cannot show a layer inside near its dtype's limit.
    """
    full = [entry for entry in history if entry.layers]
    if not full:
        return []
    last = full[-1]
    ranked = sorted(_own_values(last.layers), key=lambda layer: -_fill(layer[1], layer[2]))[:TOP_LAYERS]
    lines = [f"Step {last.step} measured every module's output (a per-module step); the largest, "
             "nearest their dtype's limit first:"]
    lines.extend(f"{module_label(name)}: {_magnitude(value, dtype)}" for name, value, dtype, _path in ranked)
    if producer is not None:
        seen = [(entry.step, value, dtype) for entry in full for name, value, dtype, _path in entry.layers
                if name == producer]
        if seen:
            lines.append(f"The producer, {module_label(producer)}, on the per-module steps: " + "; ".join(
                f"step {step}: {_magnitude(value, dtype)}" for step, value, dtype in seen[-3:]))
    return lines


def _own_values(layers: tuple[_Layer, ...]) -> list[_Layer]:
    """The layers without the parents that only return a child's value (a Sequential, a block ending in a norm)."""
    by_value: dict[tuple[float, str], list[tuple[str, ...]]] = {}
    for _name, value, dtype, path in layers:
        by_value.setdefault((value, dtype), []).append(path)
    return [layer for layer in layers if not any(inside(other, layer[3]) for other in by_value[(layer[1], layer[2])])]


def _fill(value: float, dtype: str) -> float:
    """How full the dtype's range is: |value| over its largest finite value."""
    limit = finite_limit(dtype)
    return value / limit if limit else 0.0


def _magnitude(value: float, dtype: str) -> str:
    """``"max |output| 516, headroom 127x (float16)"``; a wider dtype also says what float16 would leave."""
    limit = finite_limit(dtype)
    text = f"max |output| {fmt_number(value)}"
    if limit and value > 0:
        text += f", headroom {_times(limit / value)} ({dtype})"
        if dtype != "float16":
            text += f", {_times(FINITE_LIMITS['float16'] / value)} in float16"
    return text


def _times(ratio: float) -> str:
    """``16,811x``, ``1.5x``: a headroom as people read it (no exponent below a billion)."""
    return f"{ratio:,.0f}x" if 100 <= ratio < 1e9 else f"{ratio:.3g}x"
