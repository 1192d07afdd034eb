"""The optimizer step's checks: the gradients before it, the parameters after it.

step_checks (the pre- and post-hooks: one fused read of every gradient, the parameters after a
step at its cadence), step_layout (what a step touches, and whether it can make a finite
parameter non-finite), layouts (each optimizer's layout, its names), running_stats (BatchNorm's
statistics read with the gradients), iterations (which iteration an event belongs to),
headroom (half-precision parameters copied near their limit) and the cold side, read only at
an event: step_reports (what a non-finite read is reported as) and lr_schedulers (the
scheduler that set a non-finite rate).
"""
