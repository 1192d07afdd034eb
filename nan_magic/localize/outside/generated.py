"""The user's line behind an op that code torch.fx generated ran: a ``torch.compile``d loss run by an eager backend.

Dynamo turns a compiled function into a graph and runs it as a ``GraphModule``'s generated ``forward``
(``<eval_with_key>``, no file the user can open). The recorder of the code outside the models (recorder.py) passes
over that frame to the compiled function's own, which stands at its ``def`` line while the graph runs: every op
of the loss would be named there. The generated frame's line says which graph node runs (the module's
``_lineno_map``), and the node's ``stack_trace`` the user's line that made it. Asked per op only where an op's
walk passed a generated frame (sources.GENERATED): a compiled region; cached per generated line.
"""

from __future__ import annotations

import re
from types import CodeType, FrameType

__all__ = ["generated_line"]

#: ``(id(generated code), generated line, id(user code))`` -> (both codes, held so their ids stay theirs; the line).
_LINES: dict[tuple[int, int, int], tuple[CodeType, CodeType, int | None]] = {}
#: One entry of a node's ``stack_trace`` (Python's traceback format).
_ENTRY = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)', re.MULTILINE)


def generated_line(generated: FrameType, user: CodeType, line: int) -> int:
    """The line of ``user`` (the compiled function's code) whose op the generated frame ``generated`` runs now, else
    ``line`` (where no node or stack trace says: a graph built without them)."""
    key = (id(generated.f_code), generated.f_lineno, id(user))
    found = _LINES.get(key)
    if found is None:
        found = _LINES[key] = (generated.f_code, user, _traced_line(generated, user))
    return line if found[2] is None else found[2]


def _traced_line(generated: FrameType, user: CodeType) -> int | None:
    """The line in ``user``'s code that the graph node the generated frame runs was traced from: the innermost
    entry of the node's stack trace in that code (a helper the compiled function called, inlined by Dynamo, is
    named at the line that called it: the recorded frame is the compiled function's)."""
    module = generated.f_locals.get("self")
    lines = getattr(module, "_lineno_map", None)
    graph = getattr(module, "graph", None)
    if not isinstance(lines, dict) or graph is None:
        return None
    index = lines.get(generated.f_lineno - getattr(module, "_prologue_start", 0))
    nodes = list(graph.nodes)
    if not isinstance(index, int) or not 0 <= index < len(nodes):
        return None
    trace = nodes[index].meta.get("stack_trace")
    if not isinstance(trace, str):
        return None
    inside = [int(entry["line"]) for entry in _ENTRY.finditer(trace)
              if entry["file"] == user.co_filename and entry["function"] == user.co_name]
    return inside[-1] if inside else None
