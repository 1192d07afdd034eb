"""The package's version (a module of its own: the crash scene records it, below the package's front)."""

__version__ = "0.1.0"
