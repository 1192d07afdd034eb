"""The steady state: what runs on every healthy step, in layers (pyproject.toml's contract `hot`).

step_cycle.py (a step opens, closes, and is judged) over checks/ (the hooks' checkers, one per
phase) over kept/ (what a step keeps for an event) over watched/ (what is watched, and the
global module hooks) over stats.py (a tensor's exact numbers, at an event) over reads.py (what
of a tensor is read, and the reads that say whether it is finite). docs/how-it-watches.md draws it.
"""
