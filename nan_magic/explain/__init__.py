"""A report's facts to its likely cause and the fix to try (diagnosis rules)."""
