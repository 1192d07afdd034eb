"""The checkers the watch's hooks call, one per phase, and what only they consult.

forward (the global module hooks' checks: the batch, each checked output), gradients (the
loss, the gradient into each model output, the parameter gradients; loss_region, the loss
code's autograd nodes), optim (the optimizer's pre- and post-hooks: the fused gradient read,
the parameters after a step; step_layout, whether a step is bounded; iterations, which
iteration an event belongs to; headroom, half-precision parameters copied near their limit;
optim_reports, the cold side: what a non-finite read is reported as), early (early warnings
from each step's summary) and hosts (the Protocols the checkers read of the watch and call of
the localizer through). The step cycle (hot/step_cycle.py) drives them from above.
"""
