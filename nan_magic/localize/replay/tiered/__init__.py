"""The tiered watch's replay of a failing step: what each top-level call keeps (step_keeping), the kept calls run
again (root_calls), the step replayed (step) and its backward half (step_backward)."""
