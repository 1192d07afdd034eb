"""Op-level tracing: the aten op that made a non-finite value, its line, and the tables the tracer keeps."""
