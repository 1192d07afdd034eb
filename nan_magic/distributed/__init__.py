"""Many processes: ranks, the user's names of wrapped models, agreement between ranks."""
