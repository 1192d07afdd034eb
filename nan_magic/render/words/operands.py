"""The user's names for an op's operands, read from the source line.

The op tracer labels an op's tensor arguments by their aten schema names
(``self``, ``other``, ``mat2``): exact, but not what the user wrote. The
engine does not know the user's expressions, so they are derived here from
the text of the producer's line, and only where that is unambiguous: the
line parses on its own and holds exactly one expression that can have run
the op (one ``/`` for ``aten.div``, one ``log(...)`` call for
``aten.log``), counting every form that runs it (``/``, ``torch.div``,
``x.div_``), and no other call that may run it inside (``F.normalize``
divides, so may a user's function). An op in the backward phase ran on no
line of the user's (save a custom Function's backward). Anything else keeps
the schema names: a wrong name is worse than the schema's.

Stdlib only (the text report uses it).
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Collection

from nan_magic.records import Phase, Report, TensorRef, TensorRole
from nan_magic.tensor_refs import op_function

#: aten op base name -> the Python operator that runs it.
_OPERATORS: dict[str, type[ast.operator]] = {
    "div": ast.Div, "true_divide": ast.Div, "mul": ast.Mult, "add": ast.Add,
    "sub": ast.Sub, "mm": ast.MatMult, "bmm": ast.MatMult, "matmul": ast.MatMult,
    "pow": ast.Pow, "remainder": ast.Mod, "floor_divide": ast.FloorDiv,
}
#: aten op base name -> every function or method name that runs it (the in-place ones add ``_``).
_CALLED: dict[str, tuple[str, ...]] = {
    "div": ("div", "divide", "true_divide", "floor_divide"), "true_divide": ("div", "divide", "true_divide"),
    "floor_divide": ("div", "divide", "floor_divide"), "mul": ("mul", "multiply"), "sub": ("sub", "subtract"),
    "mm": ("mm", "matmul"), "bmm": ("bmm", "matmul"), "matmul": ("mm", "bmm", "matmul"),
    "remainder": ("remainder", "fmod"), "pow": ("pow", "float_power", "square"),
}
#: Python operators that run the division ops (``a // b`` runs ``aten.div.Tensor_mode``).
_DIVISIONS = (ast.Div, ast.FloorDiv)
#: Calls that run one op and no other inside (a sum, a view, a cast): a line may hold them around the op it names.
#: Any other call (``F.normalize``, a module, a user's function) may run the op itself, and then the line does not
#: say which expression ran it.
_PLAIN_CALLS = frozenset({
    "sum", "mean", "abs", "clamp", "clamp_min", "clamp_max", "clip", "exp", "expm1", "log", "log1p", "log2", "log10",
    "sqrt", "rsqrt", "norm", "float", "double", "half", "bfloat16", "int", "long", "bool", "to", "type_as", "detach",
    "clone", "contiguous", "view", "view_as", "reshape", "reshape_as", "unsqueeze", "squeeze", "flatten", "transpose",
    "permute", "t", "expand", "expand_as", "repeat", "max", "min", "amax", "amin", "maximum", "minimum", "neg",
    "relu", "sigmoid", "tanh", "softmax", "log_softmax", "cat", "stack", "ones_like", "zeros_like", "full_like",
    "ones", "zeros", "full", "tensor", "as_tensor", "arange", "len", "range", "masked_fill", "where", "gather",
    "index_select", "sign", "floor", "ceil", "round", "trunc", "lgamma", "digamma", "erf", "cumsum", "prod",
    "square", "pow", "mul", "add", "sub", "matmul", "mm", "bmm", "eye", "diag", "diagonal", "xlogy", "acos", "asin",
    "acosh", "atanh", "atan2", "hypot", "sin", "cos", "reciprocal", "item", "numel", "size", "dim", "chunk", "split",
    "narrow", "select", "fill_", "zero_", "any", "all", "isfinite", "isnan", "cumprod", "flip", "roll",
    "std", "var", "std_mean", "var_mean", "logsumexp", "median",  # (one aten op each: no division runs inside)
    "randn", "rand", "randint", "randn_like", "rand_like", "randint_like", "empty", "empty_like", "linspace",
    "backward",  # (runs backward-phase ops only, and no name is read for those)
})
#: Python's builtins (``sum(losses) / n`` adds at this line) and torch's functions that divide, imported bare
#: (``from torch.nn.functional import normalize``): calls by a bare name that may run an op at the caller's line.
_BARE_RUNNERS = frozenset(dir(builtins)) | {
    "normalize", "cosine_similarity", "pairwise_distance", "cdist", "layer_norm", "group_norm", "batch_norm",
    "instance_norm", "local_response_norm", "rms_norm", "softmax", "log_softmax", "div", "divide", "true_divide"}


def _users_callable(call: ast.Call) -> bool:
    """A call by a bare name that is no builtin nor one of torch's dividing functions: the user's model
    (``model(x) / tau``), criterion or function, whose ops ran on their own lines (a module's are the module's, a
    function's at its lines), not at this one."""
    return isinstance(call.func, ast.Name) and call.func.id not in _BARE_RUNNERS


#: Ops whose second argument is a binary op's right operand when written as a call (``torch.div(a, b)``).
_BINARY_CALLS = frozenset(_OPERATORS) | {"xlogy", "atan2", "hypot", "fmod"}
#: Schema names of a binary op's right operand.
_RIGHT = ("other", "mat2", "exponent")


def written_line(report: Report) -> str | None:
    """The line whose expressions can name the report's op and operands; None where they cannot.

    A backward op of an autograd formula (SqrtBackward0's division) ran on no line of the user's: the line reported
    made its node, and an op there of the same name (the ``/`` of ``w / (sqrt(s) + eps)``) is another op, on other
    operands (the formula's are the incoming gradient and its own terms). A Python backward's op (a custom
    Function's) ran on its line, which names it.
    """
    if report.source is None:
        return None
    if report.phase is Phase.BACKWARD and not any(note.kind == "python-backward" for note in report.note_facts):
        # The deferred check's replay may name no node: the line reported is then still the forward's, whose
        # ``v / n`` is not the backward's division (the phase says so, node or none).
        return None
    if any(note.kind == "autograd-backward" for note in report.note_facts):
        return None
    return report.source.line


def op_node(op: str | None, line: str | None) -> tuple[str, ast.AST] | None:
    """The one expression of ``line`` that can have run ``op``, with the parsed text; else None.

    A binary operator (``a / b``, ``x += y``) for the ops Python's operators
    run, else a call named like the op (``torch.log(x)``, ``x.log()``).
    None when the line does not parse alone or holds no such expression, or
    more than one.
    """
    if not op or not line:
        return None
    text = line.strip()
    try:
        tree = ast.parse(text)
    except SyntaxError:  # one line of a multi-line statement
        return None
    base = op_function(op)
    operator = _OPERATORS.get(base)
    operators: tuple[type[ast.operator], ...] = (
        _DIVISIONS if operator in _DIVISIONS else () if operator is None else (operator,))
    names = {base, *_CALLED.get(base, ())}
    names |= {f"{name}_" for name in names}
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    found: list[ast.AST] = [
        node for node in ast.walk(tree)
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, operators)
    ]
    found += [call for call in calls if _called_name(call) in names]
    if len(found) != 1:
        return None
    if any(call is not found[0] and _called_name(call) not in _PLAIN_CALLS and not _users_callable(call)
           for call in calls):
        return None  # a call that may run the op inside (F.normalize divides): the line does not say which ran it
    return text, found[0]


def op_expression(op: str | None, line: str | None) -> str:
    """What the user wrote for ``op`` on ``line``: ``"q @ k.transpose(-2, -1)"`` for ``aten.bmm``; ``""`` if unclear."""
    found = op_node(op, line)
    if found is None:
        return ""
    text, node = found
    return ast.get_source_segment(text, node) or ""


def operand_names(op: str | None, line: str | None, tensors: Collection[str] | None = None) -> dict[str, str]:
    """Schema argument name -> the expression the user wrote for it.

    ``operand_names("aten.div.Tensor", "return a / b.sqrt()")`` gives
    ``{"self": "a", "other": "b.sqrt()"}``. Empty when the line does not
    say it unambiguously. ``tensors``: the operands that were tensors (the others were Python numbers).
    """
    found = op_node(op, line)
    if found is None:
        return {}
    text, node = found
    if isinstance(node, (ast.BinOp, ast.AugAssign)):
        left = node.left if isinstance(node, ast.BinOp) else node.target
        right = node.right if isinstance(node, ast.BinOp) else node.value
        if (isinstance(node, ast.BinOp) and op_function(op) in _REFLECTED and tensors is not None
                and not any(name in tensors for name in _RIGHT)):
            # A tensor and a Python number: torch runs ``lr * g`` as mul(g, lr), the tensor first whichever side it
            # is written on; only a literal says which side holds the number. (``t / x`` and ``1 - x`` run other
            # ops, reciprocal and rsub: a div or sub's ``self`` is its left side.)
            sides = (left, right) if _literal(right) else (right, left) if _literal(left) else None
            if sides is None:
                return {}
            left, right = sides
        names = {"self": _segment(text, left)}
        names.update({name: _segment(text, right) for name in _RIGHT})
        return {key: value for key, value in names.items() if value}
    assert isinstance(node, ast.Call)
    # torch.log(x) names its operand as the first argument, x.log() as the receiver; torch.div(a, b) and a.div(b)
    # name the right operand next (xlogy(x, y)'s log operand is ``other``, y).
    if node.args and not _is_method_on_value(node):
        arguments: list[ast.expr] = list(node.args)
    elif isinstance(node.func, ast.Attribute) and _is_method_on_value(node):
        if isinstance(node.func.value, ast.Name) and len(node.args) >= (2 if op_function(op) in _BINARY_CALLS else 1):
            return {}  # (``th.div(a, b)``, ``th.log(x)``: torch under another name, not a tensor's method: not said)
        arguments = [node.func.value, *node.args]
    else:
        return {}
    names = {"self": _segment(text, arguments[0])}
    if op_function(op) in _BINARY_CALLS and len(arguments) > 1 and not isinstance(arguments[1], ast.Starred):
        names.update({name: _segment(text, arguments[1]) for name in _RIGHT})
    return {key: value for key, value in names.items() if value}


#: Ops Python reaches from either side of a number (``__rmul__``, ``__radd__``), with the tensor as ``self``.
_REFLECTED = ("mul", "add")


def _literal(node: ast.expr) -> bool:
    """A number written out: ``2``, ``-1.0``, ``float("-inf")``."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) or (
        isinstance(node, ast.Call) and _called_name(node) == "float" and all(_literal(arg) for arg in node.args))


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    if isinstance(call.func, ast.Name):
        return call.func.id
    return None


#: Names that start a path to a module of functions, never a tensor: ``torch.log(x)``, ``F.mse_loss(a, b)``.
_FUNCTION_MODULES = ("torch", "F", "functional", "nn", "math")


def _is_method_on_value(call: ast.Call) -> bool:
    """``x.log()`` rather than ``torch.log(x)`` / ``F.softmax(x)`` / ``nn.functional.mse_loss(a, b)``."""
    if not isinstance(call.func, ast.Attribute):
        return False
    owner = call.func.value
    while isinstance(owner, ast.Attribute):  # torch.nn.functional, torch.special: a dotted path to a module
        owner = owner.value
    return not (isinstance(owner, ast.Name) and owner.id in _FUNCTION_MODULES)


def _segment(text: str, node: ast.expr) -> str:
    return ast.get_source_segment(text, node) or ""


#: Longest user expression kept whole in a label; longer ones keep their start.
MAX_EXPRESSION = 36


def operand_label(ref: TensorRef, names: dict[str, str], op: str | None = None) -> str:
    """``"centred (self)"`` where the user's expression is known, else ``"self"``.

    An in-place op's value before it is ``"self (before)"``; with ``op``,
    ``"centred (self of aten.log.default)"``.
    """
    if ref.role is not TensorRole.OPERAND or ref.name is None:
        return str(ref)
    suffix = (" (before)" if ref.before else "") + (f" of {op}" if op else "")
    user = names.get(ref.name)
    if not user:
        return f"{ref.name}{suffix}"
    if len(user) > MAX_EXPRESSION:
        user = user[: MAX_EXPRESSION - 3] + "..."
    return f"{user} ({ref.name}{suffix})"
