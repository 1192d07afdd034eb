"""Fix trials: the remedies a report suggests, tried on a replay of the failing step (issue 28)."""
