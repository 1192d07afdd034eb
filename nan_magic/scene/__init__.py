"""Crash scenes: the failing step saved to a file, loaded back and replayed; the last good state."""
