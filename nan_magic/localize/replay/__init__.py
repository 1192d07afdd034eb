"""Running again what failed: a module call, a step's model calls and backward, an optimizer step, a batch's samples."""
