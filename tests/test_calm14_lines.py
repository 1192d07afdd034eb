"""The line a report names after hot14b (ddce374): the lines the recorders note are kept per instruction, by
``(co_linetable, co_firstlineno, f_lasti)``. Loss code whose instructions the cache has seen healthy steps run, then
goes bad at step 2: a cell run again after an edit (the same first line, other lines), loss code in a generator, in
an ``exec``'d string, in a lambda, at the end of a 600-line function. The report names the loss op's line, in the
five modes; the healthy twin of each is calm.
"""

from __future__ import annotations

import importlib.util
import linecache
import textwrap

import pytest
import torch
from torch import nn
from watching import FIVE_MODES

import nan_magic
from nan_magic.hot.kept import lines

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)


def _cell(source: str, filename: str) -> object:
    """Compile ``source`` as a notebook cell: its text in linecache under ``filename``, as IPython does."""
    source = textwrap.dedent(source)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return compile(source, filename, "exec")


def _line_of(source: str, marker: str) -> int:
    found = [n for n, text in enumerate(textwrap.dedent(source).splitlines(), 1) if text.endswith(marker)]
    assert len(found) == 1
    return found[0]


def _watched(code: object, options: dict, bad_at: int | None) -> nan_magic.Watch | nan_magic.NonFiniteError:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    namespace = {"torch": torch, "model": model, "opt": opt, "bad_at": bad_at}
    try:
        with nan_magic.watch(model, opt, **options) as w:
            exec(code, namespace)
    except nan_magic.NonFiniteError as error:
        return error
    return w


CELL_V1 = """\
for step in range(4):
    out = model(torch.randn(8, 4))
    shift = 100.0 if step == bad_at else -1.0
    loss = torch.log(out.pow(2).mean() - shift)  # producer: v1
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
CELL_V2 = """\
for step in range(4):
    out = model(torch.randn(8, 4))
    # an edit: a comment, and the shift computed on two lines
    shift = -1.0
    shift = 100.0 if step == bad_at else shift
    h = out.pow(2).mean()
    loss = torch.log(h - shift)  # producer: v2
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
GENERATOR = """\
def losses():
    for step in range(4):
        out = model(torch.randn(8, 4))
        shift = 100.0 if step == bad_at else -1.0
        yield torch.log(out.pow(2).mean() - shift)  # producer: generator

for loss in losses():
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
LAMBDA = """\
loss_fn = lambda out, shift: torch.log(out.pow(2).mean() - shift)  # producer: lambda
for step in range(4):
    loss = loss_fn(model(torch.randn(8, 4)), 100.0 if step == bad_at else -1.0)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _check(result, options: dict, line: int, bad_at: int | None) -> None:
    if bad_at is None:
        assert isinstance(result, nan_magic.Watch) and result.report is None, result
        return
    assert isinstance(result, nan_magic.NonFiniteError), result
    report = result.report
    assert (report.phase.value, report.module, report.step, report.op) == ("forward", None, 2, "aten.log.default")
    assert report.source is not None and report.source.lineno == line, report.source


@pytest.mark.parametrize("same_file", [False, True], ids=["own-filenames", "one-filename"])
@pytest.mark.parametrize("bad_at", [None, 2], ids=["healthy", "broken"])
@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_cell_run_again_after_an_edit_is_named_at_its_new_line(options: dict, bad_at: int | None,
                                                                  same_file: bool) -> None:
    # The first run: the same first line, healthy; the cell's second version under its own filename (IPython), or
    # under the first's (a script edited and run again, %run).
    first, second = ("<cell-calm14-1>", "<cell-calm14-1>" if same_file else "<cell-calm14-2>")
    _check(_watched(_cell(CELL_V1, first), options, None), options, 0, None)
    code = _cell(CELL_V2, second)
    result = _watched(code, options, bad_at)
    _check(result, options, _line_of(CELL_V2, "# producer: v2"), bad_at)
    if not options.get("ops"):  # (the recorders, not the op tracer, read lines by instruction: hot/kept/lines.py)
        assert any(key[0] == code.co_linetable for key in lines.LINES)
    if bad_at is not None:
        assert "producer: v2" in result.report.source.line
    # and back to the first version: its own line again
    result = _watched(_cell(CELL_V1, first), options, bad_at)
    _check(result, options, _line_of(CELL_V1, "# producer: v1"), bad_at)
    if bad_at is not None:
        assert "producer: v1" in result.report.source.line


@pytest.mark.parametrize("bad_at", [None, 2], ids=["healthy", "broken"])
@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", ["generator", "lambda", "exec-string"])
def test_loss_code_in_a_generator_a_lambda_an_exec_string_is_named_at_its_line(
        name: str, options: dict, bad_at: int | None) -> None:
    if name == "exec-string":  # no text for it in linecache: the line number alone
        source, code = CELL_V1, compile(CELL_V1, "<string>", "exec")
        line = _line_of(CELL_V1, "# producer: v1")
    else:
        source = GENERATOR if name == "generator" else LAMBDA
        code, line = _cell(source, f"<cell-calm14-{name}>"), _line_of(source, f"# producer: {name}")
    _check(_watched(code, options, bad_at), options, line, bad_at)


def _long_module(tmp_path) -> tuple[object, int]:
    """A module whose ``train`` is 600 lines long, the loss op on its last lines."""
    body = [f"    a{i} = {i}" for i in range(590)]
    source = "\n".join([
        "import torch", "", "",
        "def train(model, opt, bad_at):",
        *body,
        "    for step in range(4):",
        "        out = model(torch.randn(8, 4))",
        "        shift = 100.0 if step == bad_at else -1.0",
        "        loss = torch.log(out.pow(2).mean() - shift)  # producer: long",
        "        opt.zero_grad()",
        "        loss.backward()",
        "        opt.step()",
        "",
    ])
    path = tmp_path / "calm14_long_train.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("calm14_long_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, _line_of(source, "# producer: long")


@pytest.mark.parametrize("bad_at", [None, 2], ids=["healthy", "broken"])
@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_loss_op_at_the_end_of_a_600_line_function_is_named_at_its_line(tmp_path, options: dict,
                                                                           bad_at: int | None) -> None:
    module, line = _long_module(tmp_path)
    assert line > 590
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    try:
        with nan_magic.watch(model, opt, **options) as w:
            module.train(model, opt, bad_at)
        result = w
    except nan_magic.NonFiniteError as error:
        result = error
    _check(result, options, line, bad_at)
    if bad_at is not None:
        assert "producer: long" in result.report.source.line
