"""The steady state: what runs on every healthy step, in layers (pyproject.toml's contract `hot`).

step_cycle.py (a step opens, closes, and is judged) over checks/ (the hooks' checkers, one per
phase) over kept/ (what a step keeps for an event) over watched/ (what is watched, and the
global module hooks) over stats.py (tensors to numbers). docs/how-it-watches.md draws it.
"""
