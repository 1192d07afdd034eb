"""Only render/ writes sentences (issue 25, item 5; PRODUCT.md: "a cause carries its kind and its numbers; only
the renderers write sentences"): the engine keeps a reason as its kind and its values, never as words.

An AST scan of nan_magic/ outside render/ for string literals (an f-string as a whole) of six or more words. What
may hold one, and why: docstrings; an exception's or a warning's message, given where it is raised (``raise``,
``warnings.warn``, ``pytest.fail``), and a front end's status line where it prints it; a flag's help (``help=``,
``description=``: argparse, the magics' ``@argument``, a pytest marker's line); a regex (a raw string, or the
pattern of an ``re`` call); and the few places in :data:`_ALLOWED`, each with why its words are no fact of a report.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import nan_magic
from nan_magic.localize.replay.line_replay import IN_TRANSFORM, NO_CALL, NOT_KEPT, NOT_REACHED
from nan_magic.records import Note

_PACKAGE = pathlib.Path(nan_magic.__file__).parent
#: A string of this many words or more is a sentence.
_WORDS = 6
#: The calls whose arguments are a message raised or warned to the user, a marker's help, or a front end's status
#: line it prints (the engine prints nothing: DESIGN.md).
_MESSAGE_CALLS = frozenset({"warn", "warn_explicit", "fail", "addinivalue_line", "print"})
#: The keyword arguments that are a flag's or a command's help.
_HELP_KEYWORDS = frozenset({"help", "description", "epilog", "usage"})
#: The ``re`` functions whose first argument is a pattern.
_RE_CALLS = frozenset({"compile", "search", "match", "fullmatch", "sub", "subn", "findall", "finditer", "split"})

#: ``(module, function)`` -> why its sentences are words of their own, not a fact of a report made into words.
_ALLOWED: dict[tuple[str, str], str] = {
    ("options.py", "WatchConfig"): "every option's help, declared once: watch()'s docstring, the magics' and the "
                                   "CLI's flags are generated from it",
    ("ipython/magics.py", "NanMagics._turn_off"): "the magic's status line, printed as the user turns the watch off",
    ("ipython/magics.py", "NanMagics._describe"): "the magic's status line: how the watch is set up",
    ("ipython/magics.py", "NanMagics._status"): "the magic's status line: whether a watch is on",
    ("ipython/magics.py", "NanMagics.nanwatch"): "the magic's status line, printed as the user turns the watch on "
                                                 "again while it is on",
    ("ipython/magics.py", "_with_the_options"): "the magics' usage error, argparse's message said plainly",
    ("errors/frames.py", "short_traceback"): "the last line of the short traceback IPython shows for the "
                                             "exception (its _render_traceback_)",
    ("errors/exceptions.py", "peer_message"): "the message of the exception a peer rank raises (its args)",
    ("lifecycle/filters.py", "warn_unmatched_filters"): "a warning's message, built before it is warned at the "
                                                        "user's line",
    ("hot/watched/targets.py", "resolve_targets"): "part of the TypeError's message, raised just below",
}


def _sentences(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """``(function, line, text)`` of each sentence in ``path`` that no rule of the module docstring lets stand."""
    source = path.read_text()
    tree = ast.parse(source)
    exempt: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):  # docstrings, and any bare string statement
            exempt.update(id(statement.value) for statement in body
                          if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))
        if isinstance(node, ast.Raise) or (isinstance(node, ast.Call) and _called(node) in _MESSAGE_CALLS):
            exempt.update(id(sub) for sub in ast.walk(node))
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg in _HELP_KEYWORDS:
                    exempt.update(id(sub) for sub in ast.walk(keyword.value))
            if _called(node) in _RE_CALLS and isinstance(node.func, ast.Attribute) and node.args and isinstance(
                    node.func.value, ast.Name) and node.func.value.id == "re":
                exempt.update(id(sub) for sub in ast.walk(node.args[0]))
    found = []
    for function, node in _strings(tree, "<module>"):
        text = _words(node)
        if id(node) in exempt or len(text.split()) < _WORDS or "r" in (
                ast.get_source_segment(source, node) or "'").split("'")[0].split('"')[0].lower():  # (raw: a regex)
            continue
        found.append((function, node.lineno, text))
    return found


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _strings(node: ast.AST, function: str, in_class: bool = False) -> list[tuple[str, ast.Constant | ast.JoinedStr]]:
    """Each string under ``node`` (a constant, or an f-string as a whole) with the outermost function it is in
    (``Class.method`` for a method; the class's name for its body, ``<module>`` for the module's)."""
    found: list[tuple[str, ast.Constant | ast.JoinedStr]] = []
    for child in ast.iter_child_nodes(node):
        inside, of_class = function, False
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (function == "<module>"
                                                                                         or in_class):
            inside = child.name if function == "<module>" else f"{function}.{child.name}"
            of_class = isinstance(child, ast.ClassDef)
        if isinstance(child, ast.JoinedStr) or (isinstance(child, ast.Constant) and isinstance(child.value, str)):
            found.append((function, child))
        if isinstance(child, ast.JoinedStr):  # (its parts are counted as the whole; a value inside it is code)
            found.extend(item for part in child.values if isinstance(part, ast.FormattedValue)
                         for item in _strings(part, inside))
            continue
        found.extend(_strings(child, inside, of_class or (in_class and inside == function)))
    return found


def _words(node: ast.Constant | ast.JoinedStr) -> str:
    """A string's words; an f-string's with each value it fills in as one word."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    return "".join(part.value if isinstance(part, ast.Constant) else "x" for part in node.values)


def _scan() -> dict[tuple[str, str], list[tuple[int, str]]]:
    found: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        module = path.relative_to(_PACKAGE).as_posix()
        if module.startswith("render/"):
            continue
        for function, line, text in _sentences(path):
            found.setdefault((module, function), []).append((line, text))
    return found


def test_no_module_outside_render_writes_a_sentence() -> None:
    """A reason kept as words (a trial's "not tried: ..." as an English string) is a sentence outside render/: it
    is kept as a Note (its kind and values) and render/words/ writes it."""
    written = {place: lines for place, lines in _scan().items() if place not in _ALLOWED}
    assert written == {}


def test_each_allowed_place_still_holds_a_sentence() -> None:
    """An entry whose sentences moved goes, so that the list stays the places that need it."""
    assert sorted(set(_ALLOWED) - set(_scan())) == []


@pytest.mark.parametrize(("reason", "words"), [
    (NOT_REACHED, "a replay of the call did not make that line's autograd node again"),
    (NO_CALL, "no model call of the step that made that line's autograd node was kept to replay"),
    (IN_TRANSFORM, "the call that made that line's autograd node ran inside a torch.func transform (vmap, jacrev)"),
    (NOT_KEPT, "ops=True keeps the step's model calls for the fix trials only, and fixes=False (or replay=False) "
               "keeps none"),
    ("a reason a scene of an older version kept as its words", "a reason a scene of an older version kept as its "
                                                               "words"),
], ids=["not-reached", "no-call", "in-transform", "not-kept", "older-scene"])
def test_why_debug_is_not_at_the_forward_line_reads_as_it_did(reason: object, words: str) -> None:
    """The reasons localize/replay/line_replay.py gave as sentences are notes' pairs now, with the same words."""
    note = Note.of("debug-not-replayed", reason=reason)
    assert note.text.endswith(f"opens where the step was judged, not at the forward line: {words}")


@pytest.mark.parametrize(("what", "words"), [("builtins.eval", "builtins.eval"),
                                             (None, "a pickle instruction torch does not load safely")])
def test_a_refused_scene_part_reads_as_it_did(what: str | None, words: str) -> None:
    assert Note.of("refused", what=what).text == (
        f"loading it needs {words}, which is neither a tensor nor a plain value and could run code (torch.load "
        "weights_only=True refuses it)")


def test_the_scan_finds_a_reason_written_as_words(tmp_path: pathlib.Path) -> None:
    """The scan is no test that cannot fail: a reason returned as words is found (an f-string whose parts are short,
    as fixes/runner.py's time budget was), a raised message, a regex and a docstring are not."""
    module = tmp_path / "reasons.py"
    module.write_text(
        '"""A module whose docstring is a sentence of many words."""\n'
        "import re\n"
        "def why(budget):\n"
        '    """Why the trial was not run, in a docstring of words."""\n'
        "    if budget is None:\n"
        '        raise ValueError("the budget is missing and the trial cannot run")\n'
        '    re.compile("a pattern of many words that is a regex")\n'
        "    pattern = r'a raw string of many words that is a regex'\n"
        '    return f"the time budget ({budget:.2g} s) was spent"\n')
    assert [(function, line) for function, line, _text in _sentences(module)] == [("why", 9)]
