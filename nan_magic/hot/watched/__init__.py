"""What a watch looks at, and how its hooks reach it: the bottom of the hot path above stats.py and reads.py.

targets (the watched modules with the names the user knows them by, the optimizers and
scalers), coverage (which module calls a step checks: the mode's), module_hooks (torch's
two global module hooks, stepping aside while a compiled or top-level model runs),
transparent (pass-through modules: no check of their own), deterministic (which calls
draw no random numbers, so keep no RNG state) and owner (whether a hook's call is the watch's own).
"""
