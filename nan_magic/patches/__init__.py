"""Process-wide patches while a watch needs them (Tensor.backward, GradScaler, torch.save), through registry.py."""
