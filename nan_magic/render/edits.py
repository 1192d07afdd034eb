"""The edit a verified fix stands for: the producer's line as the remedy changed it.

The edit is made with ``ast`` from the line the report holds: each call or operator that the remedy changes gets
the change (``torch.log(p)`` -> ``torch.log(p.clamp_min(1.2e-07))``), every one of the line's, as the trial changed
every call of the function made at the line (fixes/site.py): an edit of the first alone (``torch.log(p) +
torch.log(1 - p)``) is not the remedy that was verified; where the line is not one the edit can be made on, none is
shown.
"""

from __future__ import annotations

import ast
import math

from nan_magic.fix_records import BOUNDED_FUNCTIONS, SHIFTED_FUNCTIONS, UNIT_FUNCTIONS, whole_power
from nan_magic.locations import name_location
from nan_magic.records import FixTrial
from nan_magic.render.edit_numbers import domain_positions
from nan_magic.render.edit_numbers import math_call as _math_call
from nan_magic.render.edit_numbers import may_be_number as _may_be_number
from nan_magic.render.edit_numbers import python_number as _python_number
from nan_magic.render.edit_numbers import value_of as _value
from nan_magic.render.words.causes.phrases import fmt

__all__ = ["suggested_edit"]

_DOMAIN_CALLS = {"log": "log", "log2": "log2", "log10": "log10", "log1p": "log1p", "sqrt": "sqrt",
                 "rsqrt": "rsqrt", "pow": "pow", "reciprocal": "reciprocal", "acos": "acos", "asin": "asin",
                 "atanh": "atanh", "div": "div", "logit": "logit", "erfinv": "erfinv", "special_ndtri": "ndtri"}


def suggested_edit(trial: FixTrial) -> str | None:
    """The producer's line as the remedy changed it, ``file:line: code`` (None where it cannot be written)."""
    if trial.kind == "lr":
        return f"lower the learning rate: lr={fmt(trial.fact('new_lr'))} (a learning-rate warm-up also helps)"
    if trial.kind == "eps" and trial.fact("new_eps") is not None:
        if trial.fact("group_eps"):  # (remedies/optimizer_step.py: a group's eps apart from the constructor's)
            return (f"group['eps'] = {fmt(trial.fact('new_eps'))}  (where your code sets a param group's eps, or "
                    f"gives one to add_param_group: {trial.fact('optimizer')}(..., eps=...) sets only the groups it "
                    "is built with)")
        return f"{trial.fact('optimizer')}(..., eps={fmt(trial.fact('new_eps'))})"
    if trial.kind == "scale":
        if trial.fact("new_scale") is None:
            return None
        scale = _power_of_two(trial.fact("new_scale"))
        built = _scaler_line(trial.fact("scaler_line"), scale)
        if built is not None:
            return f"{name_location(trial.fact('scaler_file'), trial.fact('scaler_lineno'))}: {built}"
        return f"GradScaler(..., init_scale={scale})  (where the scaler is built; its scale grows back by itself)"
    if trial.kind == "skip-batch":
        return "keep = torch.isfinite(x).flatten(1).all(1); x, y = x[keep], y[keep]  (x the batch, y its targets)"
    source = trial.source
    if source is None or not source.line:
        return None
    try:
        tree = ast.parse(source.line.strip())
    except SyntaxError:
        return None
    unchanged = ast.unparse(tree)
    edit = _Edit(trial, tree)
    code: str | None = ast.unparse(edit.visit(tree))
    if not edit.done or edit.unsure or code == unchanged:  # (the user's own line is no edit)
        return None
    if trial.fact("every_use"):  # (fixes/remedies/every_use.py: the operand clamped at each of its uses)
        code = _every_use(trial, ast.parse(source.line.strip()), edit.operands)
    if code is None:
        return None
    regions = trial.fact("autocast") or ()
    if trial.kind == "float32" and regions:
        code = f"with torch.autocast({regions[0]!r}, enabled=False): {code}"
    return f"{name_location(source.filename, source.lineno)}: {code}"


def _whole(node: ast.expr | None, trial: FixTrial, written: set[float]) -> bool:
    """Whether the pow of exponent ``node`` is one the eps trial left as it was: a whole power written as a number
    (``2``, ``3.0``); or one held in a name (``** P``, a config's 2) where each exponent the trial clamped the base of
    is written on the line as a number (``written``), so that this one is not among them."""
    if isinstance(node, ast.Constant):
        return whole_power(node.value)
    clamped = trial.fact("exponents")
    return node is not None and clamped is not None and set(clamped) <= written


def _written_exponents(tree: ast.AST) -> set[float]:
    """The exponents the line writes as numbers: ``x ** 0.5``, ``x.pow(0.5)``, ``torch.pow(x, 0.5)``."""
    found: list[ast.expr | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            found.append(node.right)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pow":
            found.append(_exponent(node))
    return {float(node.value) for node in found if isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)}


def _exponent(node: ast.Call) -> ast.expr | None:
    """The exponent of a pow call: ``x.pow(e)``'s first argument, ``torch.pow(x, e)``'s second, or ``exponent=``."""
    given = next((keyword.value for keyword in node.keywords if keyword.arg == "exponent"), None)
    position = 1 if _on_torch(node) else 0
    return given if given is not None else (node.args[position] if len(node.args) > position else None)


def _scaler_line(line: str | None, scale: str) -> str | None:
    """The line that built the GradScaler with its initial scale ``scale`` (replacing the one it had, if any)."""
    try:
        tree = ast.parse((line or "").strip())
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not ast.unparse(node.func).endswith("GradScaler"):
            continue
        value = ast.Name("INIT_SCALE")  # written as the scale's power of two after unparse
        given = next((keyword for keyword in node.keywords if keyword.arg == "init_scale"), None)
        # Positionally: torch.amp.GradScaler(device, init_scale, ...), torch.cuda.amp.GradScaler(init_scale, ...).
        position = 0 if "cuda" in ast.unparse(node.func) else 1
        if given is not None:
            given.value = value
        elif len(node.args) > position:
            node.args[position] = value
        else:
            node.keywords.append(ast.keyword("init_scale", value))
        return ast.unparse(tree).replace("INIT_SCALE", scale)
    return None


#: The fused form of a log of each function (a softmax's, a sigmoid's), as the stable remedy computes it: the
#: function's name on the line, the form the trial recorded, the fused function.
_FUSED_LOGS = {"softmax": ("log_softmax", "torch.log_softmax"),
               "sigmoid": ("logsigmoid", "torch.nn.functional.logsigmoid"),
               "ndtr": ("log_ndtr", "torch.special.log_ndtr"), "det": ("logdet", "torch.logdet")}


class _Edit(ast.NodeTransformer):
    """Rewrites each call or operator of the line the remedy changed (see the module docstring)."""

    def __init__(self, trial: FixTrial, tree: ast.AST) -> None:
        self.trial = trial
        self.written = _written_exponents(tree)
        #: The line's pows: with more than one, a base clamped under an exponent no fact decides is not the edit the
        #: trial ran (``((a - b) ** P).sum(-1) ** (1 / P)``: the trial clamped the root's base only): no edit.
        self.pows = sum((isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pow")
            for node in ast.walk(tree))
        self.unsure = False
        self.done = False
        self.operands: dict[str, bool] = {}  # (as written: whether a name or an attribute of one, not a call)
        #: The calls made to compute in float32: their result needs no ``.float()``.
        self.upcast: set[int] = set()
        numbers = self.trial.fact("numbers") or ()
        #: Where the float32 trial was given a Python number: ``(function, argument index)``.
        self.numbers = {(name, at) for name, at, _value in numbers}
        #: ... of those, the ones no number written on the line (``0.5``, ``1 / 3``) at that place accounts for:
        #: there a name, an attribute or an item (``scale``, ``self.cfg["scale"]``) holds the number.
        self.named = {(name, at) for name, at, value in numbers if (name, at, value) not in _written(tree)}
        #: ``(function, positional count, a keyword was a tensor)`` of each call the trial saw.
        self.positional: tuple[tuple[str, int, bool], ...] = self.trial.fact("positional") or ()

    def _undecided(self, exponent: ast.expr | None) -> bool:
        """Whether no fact says if the trial clamped the base of this pow: an exponent that is no number on the
        line (``** (1 / P)``), with more pows on the line, and a number the trial clamped under that is not
        written there (a tensor exponent's trial records none: every such pow was clamped)."""
        clamped = self.trial.fact("exponents")
        return (self.pows > 1 and not isinstance(exponent, ast.Constant) and bool(clamped)
                and not set(clamped) <= self.written)

    def _operand(self, node: ast.expr) -> ast.expr:
        """An operand the eps edit clamps, as written (every_use: each of its uses on the line is clamped)."""
        self.operands[ast.unparse(node)] = all(
            isinstance(part, (ast.Name, ast.Attribute, ast.Load)) for part in ast.walk(node))
        return node

    def _mark(self, node: ast.expr) -> ast.expr:
        self.done = True
        return node

    def visit_Subscript(self, node: ast.Subscript) -> ast.expr:
        """``price[i:i + 64]``: the float32 edit upcasts the subscripted tensor, never its index (``i.float()``)."""
        if self.trial.kind == "float32":
            node.value = self.visit(node.value)
        return node if self.trial.kind == "float32" else self.generic_visit(node)  # type: ignore[return-value]

    def visit_BinOp(self, node: ast.BinOp) -> ast.expr:
        if self.trial.kind == "float32":
            return self._float32_operator(node)
        self.generic_visit(node)
        kind, function = self.trial.kind, self.trial.fact("function")
        if kind == "eps" and function in ("div", "reciprocal") and isinstance(node.op, ast.Div):
            node.right = _denominator(self._operand(node.right), self.trial)
            return self._mark(node)
        if kind == "eps" and function == "pow" and isinstance(node.op, ast.Pow) and not _whole(
                node.right, self.trial, self.written):
            self.unsure |= self._undecided(node.right)
            node.left = _method(self._operand(node.left), "clamp_min", _eps(self.trial))
            return self._mark(node)
        return node

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.AugAssign:
        """``x /= n``: its denominator, as ``x / n``'s."""
        self.generic_visit(node)
        if (self.trial.kind == "eps" and self.trial.fact("function") == "div"
                and isinstance(node.op, ast.Div)):
            node.value = _denominator(self._operand(node.value), self.trial)
            self._mark(node.value)
        return node

    def visit_Call(self, node: ast.Call) -> ast.expr:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        kind, function = self.trial.kind, self.trial.fact("function")
        if kind == "float32":
            return self._float32_call(node, name)
        self.generic_visit(node)
        method = isinstance(node.func, ast.Attribute) and not node.args and name != "float"
        if kind == "eps" and name is not None and name.removesuffix("_") == _DOMAIN_CALLS.get(function or ""):
            if function == "div":
                # torch.div(x, n), or the method x.div(n) and x.div_(n): the denominator is the last positional
                denominator = 1 if _on_torch(node) else 0
                if len(node.args) > denominator:
                    node.args[denominator] = _denominator(self._operand(node.args[denominator]), self.trial)
                    return self._mark(node)
                return node
            if function == "pow" and _whole(_exponent(node), self.trial, self.written):
                return node  # (x.pow(2): the trial left it as it was, domain.py)
            if function == "pow":
                self.unsure |= self._undecided(_exponent(node))
            clamp = "clamp" if function in BOUNDED_FUNCTIONS else "clamp_min"
            if method and name.endswith("_"):  # u.erfinv_(): u clamped in place first, as the trial did (domain.py)
                clamp += "_"
            # x.pow(0.5): a tensor method with an argument, the exponent; the operand is its receiver, as for x.log().
            if method or (function == "pow" and isinstance(node.func, ast.Attribute) and not _on_torch(node)):
                assert isinstance(node.func, ast.Attribute)
                node.func.value = _method(self._operand(node.func.value), clamp, *_clamp_args(function, self.trial))
            elif node.args:
                node.args[0] = _method(self._operand(node.args[0]), clamp, *_clamp_args(function, self.trial))
            else:
                return node
            return self._mark(node)
        if kind == "stable" and function == "exp" and self.trial.fact("form") == "softplus":
            return self._softplus(node, name)
        if kind == "stable" and function == "exp" and name == "exp":
            target = node.func.value if method and isinstance(node.func, ast.Attribute) else (
                node.args[0] if node.args else None)
            if target is None:
                return node
            shifted = ast.BinOp(target, ast.Sub(), _method(target, "amax", ast.UnaryOp(ast.USub(), ast.Constant(1)),
                                                           keepdim=True))
            return self._mark(ast.Call(ast.parse("torch.exp", mode="eval").body, [shifted], []))
        if kind == "stable" and function == "log" and name == "log":
            inner = node.args[0] if node.args else (node.func.value if isinstance(node.func, ast.Attribute) else None)
            if not isinstance(inner, ast.Call):
                return node
            form, fused = _FUSED_LOGS.get(getattr(inner.func, "attr", getattr(inner.func, "id", "")), (None, None))
            # Only the op the trial fused: torch's own, called at the line (no helper named ndtr), with no out=.
            recorded, on_tensor = self.trial.fact("form"), isinstance(inner.func, ast.Attribute) and not _on_module(
                inner.func.value)
            if fused is not None and ((form == "log_ndtr") != ((recorded or form) == "log_ndtr") or self.trial.fact(
                    "fused_at_line") is False or any(
                    keyword.arg not in ("dim", "dtype") for keyword in inner.keywords) or (
                    form != "log_softmax" and len(inner.args) != (0 if on_tensor else 1))):
                return node
            if fused is not None:
                # logits.softmax(-1): the tensor is the method's receiver, the fused function's first argument. A
                # module held as an attribute (self.softmax(h), an nn.Softmax) is given its tensor as an argument:
                # an attribute of self called with more than numbers (a tensor's dim may be a name: x.softmax(d)).
                if isinstance(inner.func, ast.Attribute) and _of_self(inner.func.value) and not all(
                        _number(argument) for argument in inner.args):
                    return node  # (no edit: the module's dim is not on the line, and log_softmax needs one)
                receiver = [inner.func.value] if isinstance(inner.func, ast.Attribute) and not _on_module(
                    inner.func.value) else []
                return self._mark(ast.Call(ast.parse(fused, mode="eval").body, receiver + list(inner.args),
                                           list(inner.keywords)))
            return node
        if kind == "stable" and function == name and self.trial.fact("form") == "correction=0":
            node.keywords = [keyword for keyword in node.keywords if keyword.arg not in ("correction", "unbiased")]
            flags = [index for index, argument in enumerate(node.args)
                     if isinstance(argument, ast.Constant) and isinstance(argument.value, bool)]
            if flags:  # std(0, True, True): the first flag is unbiased (remedies/correction.py), said False in place
                node.args[flags[0]] = ast.Constant(False)
            else:
                node.keywords.append(ast.keyword("correction", ast.Constant(0)))
            return self._mark(node)
        if kind == "mask" and name in ("softmax", "scaled_dot_product_attention"):
            return self._mark(_method(node, "nan_to_num", ast.Constant(0.0)))
        return node

    def _softplus(self, node: ast.Call, name: str | None) -> ast.expr:
        """``torch.log(1 + torch.exp(x))``, ``torch.log1p(x.exp())``: ``torch.nn.functional.softplus(x)``."""
        operand = node.args[0] if node.args else (node.func.value if isinstance(node.func, ast.Attribute) else None)
        if name == "log" and isinstance(operand, ast.BinOp) and isinstance(operand.op, ast.Add):
            ones = [side for side in (operand.left, operand.right) if _number(side) and ast.literal_eval(side) == 1]
            operand = next((side for side in (operand.left, operand.right) if ones and side is not ones[0]), None)
        elif name != "log1p":
            return node
        if not isinstance(operand, ast.Call) or _call_name(operand) != "exp":
            return node
        inner = operand.args[0] if operand.args else (
            operand.func.value if isinstance(operand.func, ast.Attribute) else None)
        if inner is None:
            return node
        return self._mark(ast.Call(ast.parse("torch.nn.functional.softplus", mode="eval").body, [inner], []))

    def _float32_operator(self, node: ast.BinOp) -> ast.expr:
        """``h * scale``: each side that may hold a tensor upcast (torch promotes the operator to float32).

        A side is a Python number where it cannot hold a tensor (``1 / 3``, ``math.sqrt(d)``: the other side is the
        tensor), or where it is a name, an attribute or an item (or arithmetic of them) and the trial was given a
        number at this operator that no number written beside it accounts for (``h * scale``, ``scale = 0.5``): it
        is left as written. Two such sides cannot be told apart: no edit (the verdict stays)."""
        names = _OPERATORS.get(type(node.op), ())
        sides = (node.left, node.right)
        certain = [_python_number(side) for side in sides]
        if all(certain):
            return node  # (Python's arithmetic: no torch call)
        named = not any(certain) and any((name, 1) in self.named for name in names)
        maybe = [named and _may_be_number(side) for side in sides]
        self.unsure |= all(maybe)
        node.left, node.right = (side if number or held else _float(self.visit(side), self.upcast)
                                 for side, number, held in zip(sides, certain, maybe))
        self.upcast.add(id(node))
        return self._mark(node)

    def _float32_call(self, node: ast.Call, name: str | None) -> ast.expr:
        """A call's tensor arguments upcast; a module's (``self.fc(x)``) also its parameters, outside autocast.

        Under autocast the edit turns autocast off for the line (suggested_edit), and a module's float32
        parameters are then used as they are: ``self.fc(x.float())``. Without autocast its half parameters
        are what overflowed: ``self.fc.float()(x.float())`` (``Module.float`` converts them in place, once).
        An argument the trial was given as a Python number or a bool (``torch.mul(h, self.cfg["scale"])``), or as
        a keyword (``F.leaky_relu(h, self.p)``: torch gets ``negative_slope=``), and a ``math`` function's call,
        are left as written: ``.float()`` there raises.
        """
        if _math_call(node):
            return node
        if name in ("float", "to", "transpose", "view", "reshape", "size"):
            self.generic_visit(node)
            return node
        node.func = self.visit(node.func)
        func = node.func
        while isinstance(func, ast.Attribute):
            func = func.value
        if isinstance(func, ast.Name) and func.id == "self":
            if not self.trial.fact("autocast"):
                node.func = _method(node.func, "float")
        elif isinstance(node.func, ast.Attribute) and not _on_module(node.func.value):
            # A tensor's method (``logvar.exp()``): the trial upcast the tensor it is called on, its receiver.
            node.func.value = _float(node.func.value, self.upcast)
        offset = 1 if isinstance(node.func, ast.Attribute) and not _on_module(node.func.value) else 0  # (receiver)
        seen = [(count, keyword) for function, count, keyword in self.positional if function == name]
        given = min((count for count, _keyword in seen), default=None)
        self.unsure |= any(keyword for _count, keyword in seen) and len(node.args) + offset > (given or 0)
        node.args = [argument if (name, index + offset) in self.numbers or (
            given is not None and index + offset >= given) else _float(self.visit(argument), self.upcast)
            for index, argument in enumerate(node.args)]
        if not seen:  # (a call the trial never saw, such as a module's: its keywords' calls edited as before)
            node.keywords = [self.visit(keyword) for keyword in node.keywords]
        self.upcast.add(id(node))
        self.done = True
        return node


#: A BinOp's operator -> the names its torch function may have in a function mode (``h * 0.5``: ``mul``).
_OPERATORS = {ast.Add: ("add", "__add__", "__radd__"), ast.Sub: ("sub", "rsub", "__sub__", "__rsub__"),
              ast.Mult: ("mul", "__mul__", "__rmul__"), ast.Div: ("div", "__truediv__", "__rtruediv__", "__rdiv__"),
              ast.Pow: ("pow", "__pow__", "__rpow__"), ast.FloorDiv: ("floor_divide", "__floordiv__", "__rfloordiv__"),
              ast.Mod: ("remainder", "__mod__", "__rmod__")}


class _EveryUse(ast.NodeTransformer):
    """Each use of the operand written ``operand`` (a name, or an attribute of one) on the line clamped where a 0 is
    out of the call's domain (``positions``), as the trial clamped it: not in the user's guard (``sigma > 0``)."""

    def __init__(self, trial: FixTrial, operand: str, positions: set[int]) -> None:
        self.trial, self.operand, self.positions, self.count = trial, operand, positions, 0

    def _use(self, node: ast.Name | ast.Attribute) -> ast.expr:
        if id(node) not in self.positions or not isinstance(node.ctx, ast.Load) or ast.unparse(node) != self.operand:
            return self.generic_visit(node)  # type: ignore[return-value]
        self.count += 1
        function = self.trial.fact("function")
        if function in ("div", "reciprocal"):
            return _denominator(node, self.trial)
        return _method(node, "clamp" if function in BOUNDED_FUNCTIONS else "clamp_min",
                       *_clamp_args(function, self.trial))

    visit_Name = visit_Attribute = _use


def _every_use(trial: FixTrial, tree: ast.AST, operands: dict[str, bool]) -> str | None:
    """The line with its one clamped operand clamped at each of its uses; None where the edit clamped another
    expression (a call: each call of it makes another tensor, which the trial did not clamp) or it is used once."""
    if len(operands) != 1 or not all(operands.values()):
        return None
    (operand,) = operands
    uses = _EveryUse(trial, operand, domain_positions(tree))
    code = ast.unparse(uses.visit(tree))  # (as many uses as the trial clamped: an alias ``s = sigma`` it clamped too)
    return code if uses.count > 1 and uses.count == 1 + int(trial.fact("every_use") or 0) else None


def _power_of_two(value: float) -> str:
    """``2.0**18`` for 262144.0 (a GradScaler's scales are powers of two), else the number."""
    exponent = math.log2(value)
    return f"2.0**{int(exponent)}" if exponent == int(exponent) else fmt(value)


def _clamp_args(function: str | None, trial: FixTrial) -> tuple[ast.expr, ...]:
    eps = _eps(trial)
    if function in BOUNDED_FUNCTIONS:
        bound = 1 - float(trial.fact("eps") or 1e-7)
        if trial.fact("dtype") == "float64":  # exactly the trial's bounds: 1 - 2.2e-16 written to 8 digits is 1.0
            eps = ast.Constant(float(trial.fact("eps") or 1e-7))
        else:
            bound = float(f"{bound:.8g}")  # (the dtype rounds it to 1 - eps again)
        return (eps if function in UNIT_FUNCTIONS else ast.Constant(-bound), ast.Constant(bound))
    if function in SHIFTED_FUNCTIONS:  # (-1 + eps, as the trial clamped: 8 digits, as the bounded ones)
        return (ast.Constant(float(f"{-1 + float(trial.fact('eps') or 1e-7):.8g}")),)
    return (eps,)


def _eps(trial: FixTrial) -> ast.Constant:
    return ast.Constant(float(f"{trial.fact('eps') or 1e-7:.2g}"))


def _on_torch(node: ast.Call) -> bool:
    """Whether a call of pow or div is a function of torch's (``torch.div(x, n)``), not a method of a tensor
    (``x.div(n)``): on ``torch``, or given two operands (``th.pow(x, 2)``: torch imported under another name)."""
    operands = len(node.args) + sum(keyword.arg in ("exponent", "other") for keyword in node.keywords)
    return isinstance(node.func, ast.Name) or (isinstance(node.func, ast.Attribute) and (
        ast.unparse(node.func.value) in ("torch", "torch.Tensor") or operands >= 2))


#: The names a call's receiver has where it is a module of functions (``torch.exp``, ``F.linear``), not a tensor.
_MODULES = frozenset({"torch", "F", "nn", "functional", "math", "np", "numpy", "special", "linalg", "fft"})


def _of_self(node: ast.expr) -> bool:
    """Whether an expression is ``self`` or an attribute of it (``self.attn``): where a model holds its modules."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _written(tree: ast.AST) -> set[tuple[str, int, float]]:
    """``(function, argument index, value)`` of each number the line writes at an operator (``h * (1 / 3)``: at
    ``mul``'s second argument, where torch is given it whichever side it stands on) or at a call's argument."""
    found: set[tuple[str, int, float]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp):
            found |= {(name, 1, value) for side in (node.left, node.right) if (value := _value(side)) is not None
                      for name in _OPERATORS.get(type(node.op), ())}
        elif isinstance(node, ast.Call):
            name = _call_name(node)
            offset = 1 if isinstance(node.func, ast.Attribute) and not _on_module(node.func.value) else 0
            found |= {(name or "", index + offset, value) for index, argument in enumerate(node.args)
                      if (value := _value(argument)) is not None}
    return found


def _number(node: ast.expr) -> bool:
    """Whether a call's argument is a number written out (``-1``, a dim): not the tensor a module is given."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def _on_module(node: ast.expr) -> bool:
    """Whether a call's receiver is a module of functions (``torch``, ``torch.nn.functional``, ``F``)."""
    while isinstance(node, ast.Attribute):
        if node.attr in _MODULES:
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id in _MODULES


def _denominator(node: ast.expr, trial: FixTrial) -> ast.expr:
    if trial.fact("form") == "count":
        return _method(node, "clamp_min", ast.Constant(1))
    if trial.fact("form") == "add":  # (a std, a variance or a norm: std + eps)
        return ast.BinOp(node, ast.Add(), _eps(trial))
    if trial.fact("form") == "zeros":
        zero = ast.Compare(node, [ast.Eq()], [ast.Constant(0)])
        return ast.Call(ast.parse("torch.where", mode="eval").body, [zero, _eps(trial), node], [])
    return _method(node, "clamp_min", _eps(trial))


def _call_name(node: ast.Call) -> str | None:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)


def _float(node: ast.expr, upcast: set[int]) -> ast.expr:
    """``node.float()``; a number stays as it is, and so does a result the edit already computes in float32."""
    if isinstance(node, (ast.Constant, ast.BinOp)) or id(node) in upcast or (
            isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant)):
        return node
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "float":
        return node
    return _method(node, "float")


def _method(node: ast.expr, name: str, *args: ast.expr, **keywords: bool) -> ast.expr:
    return ast.Call(ast.Attribute(node, name, ast.Load()), list(args),
                    [ast.keyword(key, ast.Constant(value)) for key, value in keywords.items()])
