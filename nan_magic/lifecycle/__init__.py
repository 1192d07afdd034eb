"""A watch's life: entering and leaving, nesting, its findings, events and outcome."""
