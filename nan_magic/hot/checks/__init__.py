"""The checkers the watch's hooks call, one per boundary of the step, and what only they consult.

forward.py (the global module hooks' checks: the batch, each checked output), backward/ (the
loss, the gradient into each model output, the parameter gradients where no optimizer steps),
optimizer/ (the optimizer's pre- and post-hooks: the fused gradient read, the parameters after
a step, and what a non-finite read there is reported as), early.py (early warnings from each
step's summary) and hosts.py (the Protocols the checkers read of the watch and call of the
localizer through). The step cycle (hot/step_cycle.py) drives them from above.
"""
