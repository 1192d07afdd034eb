"""The exceptions a watch raises, and tracebacks that end in the user's code."""
