"""The backward's checks: what flows back from the loss.

gradient_checks (the loss where ``backward()`` starts, the gradient into each model output, the
parameter gradients read where no optimizer steps), output_grad_hooks (the tensor hook on a
model output, holding its checker weakly), filled (a non-finite output gradient that the
output's own deliberate fill drops) and loss_region (the autograd nodes of the loss code,
walked once per backward where it was not recorded).
"""
