"""What an edited line's expressions hold: numbers written out, arithmetic on them, ``math`` calls, the places where
a 0 is out of a call's domain (edits.py).

An edit upcasts or clamps tensors; an expression that can only be a Python number is left as written (``.float()``
on it raises).
"""

from __future__ import annotations

import ast

from nan_magic.fix_records import FUNCTIONS

__all__ = ["domain_positions", "literal", "math_call", "may_be_number", "python_number", "value_of"]


def value_of(node: ast.AST) -> float | None:
    """The value of arithmetic on numbers written out (``0.5``, ``-1``, ``1 / 3``, ``2 ** 0.5``), else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = value_of(node.operand)
        return None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = value_of(node.left), value_of(node.right)
        if left is None or right is None or (isinstance(node.op, ast.Pow) and abs(right) > 64):
            return None
        try:
            return float(_ARITHMETIC[type(node.op)](left, right))
        except (ArithmeticError, ValueError, TypeError):
            return None
    return literal(node)


_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a ** b, ast.FloorDiv: lambda a, b: a // b,
               ast.Mod: lambda a, b: a % b}


def math_call(node: ast.expr) -> bool:
    """``math.sqrt(d)``: a Python number, whatever its arguments (``.float()`` on them raises)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
        node.func.value, ast.Name) and node.func.value.id == "math"


def python_number(node: ast.expr) -> bool:
    """Whether an expression cannot hold a tensor: numbers written out, ``math`` calls, arithmetic of them."""
    if isinstance(node, ast.BinOp):
        return python_number(node.left) and python_number(node.right)
    return value_of(node) is not None or math_call(node)


def may_be_number(node: ast.expr) -> bool:
    """Whether an expression may hold a Python number: a name, an attribute, an item, and arithmetic of them."""
    if isinstance(node, ast.BinOp):
        return may_be_number(node.left) and may_be_number(node.right)
    if isinstance(node, ast.UnaryOp):
        return may_be_number(node.operand)
    return isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)) or python_number(node)


def literal(node: ast.AST) -> float | None:
    """The value of a number written out (``0.5``, ``-1``, ``2e5``), else None."""
    sign = -1.0 if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) else 1.0
    node = node.operand if isinstance(node, ast.UnaryOp) else node
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return sign * float(node.value)
    return None


#: A torch function's name (``log``, ``div``, ``reciprocal_``) -> which argument is out of its domain at 0.
_DOMAIN_CALLS = {name: index for names in FUNCTIONS.values() for name, index in names.items() if name[:2] != "__"}


def domain_positions(tree: ast.AST) -> set[int]:
    """The ids of the nodes on the line where a 0 is out of the call's domain, as fix_records.DOMAIN_USES says: a
    division's divisor (``/ x``, ``/= x``, ``torch.div(n, x)``, ``n.div(x)``), a pow's base, the operand of a log, a
    root, ``reciprocal`` (``torch.log(x)``, ``x.log()``), and the tensor a view there is of (``/ x.expand(8, 2)``'s x);
    not a comparison's, a ``where``'s or ``zeros_like``'s."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            found.add(id(node.right))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            found.add(id(node.left))
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
            found.add(id(node.value))
        elif isinstance(node, ast.Call) and (index := _DOMAIN_CALLS.get(
                node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", ""))) is not None:
            named = [keyword.value for keyword in node.keywords if keyword.arg == ("input", "other")[index]]
            # ``x.log()``, ``n.div(x)``: the receiver is argument 0 (``torch.log(x)``, ``torch.div(n, x)``: not).
            method = isinstance(node.func, ast.Attribute) and len(node.args) == index and not node.keywords
            arguments = [node.func.value, *node.args] if method and isinstance(node.func, ast.Attribute) else node.args
            found.update(map(id, [*arguments[index:index + 1], *named]))
    for node in ast.walk(tree):  # (outer first: a chain of views, ``sigma[None].expand(8, 2)``, reaches its root)
        if id(node) not in found:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _VIEWS:
            found.add(id(node.func.value))  # (the trial clamped the tensor the view reads: fixes/remedies/domain.py)
        elif isinstance(node, ast.Subscript):
            found.add(id(node.value))
    return found


#: The tensor methods that return a view of the same values (``sigma.expand(8, 2)``): the tensor they are called on is
#: used where the view is.
_VIEWS = frozenset({"expand", "expand_as", "view", "view_as", "reshape", "reshape_as", "unsqueeze", "squeeze", "t",
                    "transpose", "permute", "flatten", "unflatten", "movedim", "narrow", "select", "contiguous"})
