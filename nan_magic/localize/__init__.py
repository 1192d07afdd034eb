"""The cold path: replays of a failing call or step, the producer rule, the op tracer and its tables."""
