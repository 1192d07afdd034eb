"""What a person sees in a real kernel (nbclient, ipykernel), on notebooks written as users write them.

Two notebooks, each executed once and asserted per cell:

* a session: the model in one cell, the loss helper in another, the loop in a
  third under ``%%nantrace`` (immediate, ``--defer``, ``--full``, ``--ops``),
  ``%debug`` after it; ``%nanwatch on`` over several cells, a cell that raises
  ``KeyboardInterrupt`` and one the kernel interrupts (a real SIGINT), a re-run
  after a fix, a model changed between cells, two models; bad arguments to every
  magic; ``--dump``;
* after a kernel restart: a fresh kernel opens the dumped scene (its report
  displayed, ``%nanreplay``, ``python -m nan_magic show``).

Each assertion reads what the user reads: the error's lines, the static
report, the printed fields, pdb's output, and the hooks left on the model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from jupyter_support import isolated_env, named_cell, widget_states, write_cells

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
TAB_TITLES = ["Summary", "Layers", "Histograms", "Debug", "History"]

#: What a watch could leave behind, as a list of lines (empty: nothing): hooks on any module or parameter, an
#: attribute a plain module does not have, a patched forward, torch's global hooks, a wrapped Tensor.backward.
LEFTOVERS = (
    "original_backward = torch.Tensor.backward\n"
    "def leftovers(*models):\n"
    "    from torch.nn.modules import module as M\n"
    "    from torch.optim import optimizer as O\n"
    "    found = []\n"
    "    for model in models:\n"
    "        for name, sub in model.named_modules():\n"
    "            for attribute in ('_forward_hooks', '_forward_pre_hooks', '_backward_hooks', '_backward_pre_hooks',\n"
    "                              '_forward_hooks_with_kwargs', '_forward_hooks_always_called',\n"
    "                              '_state_dict_hooks'):\n"
    "                if getattr(sub, attribute, None):\n"
    "                    found.append(f'{name}.{attribute}')\n"
    "            found += [f'{name}: {key}' for key in vars(sub) if 'nan' in key.lower() or 'watch' in key.lower()]\n"
    "            if 'forward' in vars(sub):\n"
    "                found.append(f'{name}.forward patched')\n"
    "        found += [f'hook on {n}' for n, p in model.named_parameters()\n"
    "                  if p._backward_hooks or p._post_accumulate_grad_hooks]\n"
    "    for name in ('_global_forward_hooks', '_global_forward_pre_hooks', '_global_backward_hooks',\n"
    "                 '_global_backward_pre_hooks', '_global_forward_hooks_with_kwargs'):\n"
    "        if getattr(M, name):\n"
    "            found.append(name)\n"
    "    if O._global_optimizer_pre_hooks or O._global_optimizer_post_hooks:\n"
    "        found.append('global optimizer hooks')\n"
    "    found += [f'optimizer hooks: {n}' for n in ('_optimizer_step_pre_hooks', '_optimizer_step_post_hooks')\n"
    "              if getattr(opt, n, None)]\n"
    "    if torch.Tensor.backward is not original_backward:\n"
    "        found.append('Tensor.backward wrapped')\n"
    "    return found\n"
)

#: The model cell: ``body`` divides by zero at step 3 (``h - h``); the loss helper takes a log of zero at step 2.
MODEL = (
    "class Scale(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.lin = nn.Linear(4, 4)\n"
    "    def forward(self, x, step):\n"
    "        h = self.lin(x)\n"
    "        boom = h / (h - h) if step == 3 else h\n"
    "        return boom\n"
    "class Net(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.body = Scale()\n"
    "        self.head = nn.Linear(4, 2)\n"
    "    def forward(self, x, step=0):\n"
    "        return self.head(self.body(x, step))\n"
    "torch.manual_seed(0)\n"
    "model = Net(); opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
    "xs, ys = torch.randn(8, 4), torch.randint(0, 2, (8,))"
)
#: A second model: its log layer gets -1 everywhere (its weights), at its first call.
OTHER = (
    "class LogLayer(nn.Module):\n"
    "    def forward(self, x):\n"
    "        return torch.log(x)\n"
    "class Clamped(nn.Module):\n"
    "    def forward(self, x):\n"
    "        return torch.log(x.clamp_min(1e-3))\n"
    "other = nn.Sequential(nn.Linear(4, 4), LogLayer())\n"
    "with torch.no_grad():\n"
    "    other[0].weight.fill_(0.0); other[0].bias.fill_(-1.0)"
)
LOSS = (
    "def my_loss(out, y, step):\n"
    "    p = out.softmax(-1)\n"
    "    picked = p[torch.arange(len(y)), y]\n"
    "    ll = torch.log(picked - picked) if step == 2 else torch.log(picked)\n"
    "    return -ll.mean()"
)


def loop(options: str = "") -> str:
    return (
        f"%%nantrace {options}".rstrip() + "\n"
        "for step in range(6):\n"
        "    out = model(xs, step)\n"
        "    loss = nn.functional.cross_entropy(out, ys)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()"
    )


#: One iteration of the loop as a cell of its own (``%nanwatch on``): ``k`` counts the iterations run.
ITERATION = (
    "out = model(xs, k); loss = nn.functional.cross_entropy(out, ys); opt.zero_grad(); loss.backward(); opt.step(); "
    "k += 1"
)
FIELDS = "r = _nan_report\nprint(r.phase, r.module, r.op, r.step, r.source.lineno, r.model)"

SESSION = {
    "setup": (
        "%load_ext nan_magic\nimport os, sys, tempfile\nimport torch\nfrom torch import nn\nfrom unittest import mock\n"
        + LEFTOVERS
    ),
    "model": MODEL,
    "lossfn": LOSS,
    "forward_fails": loop(),
    "forward_debug": (
        "commands = ['p h.shape, bool(h.isfinite().all()), bool((h - h).eq(0).all())', \"p 'boom' in dir()\",\n"
        "            'where', 'q']\n"
        "with mock.patch('builtins.input', side_effect=commands):\n"
        "    %debug"
    ),
    "forward_fields": FIELDS + "\nprint([(f.kind, f.module, f.finite) for f in r.fixes])\nprint(leftovers(model))",
    "loss_fails": (
        "%%nantrace\n"
        "for step in range(6):\n"
        "    out = model(xs)\n"
        "    loss = my_loss(out, ys, step)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()"
    ),
    "loss_debug": (
        "commands = ['p bool(picked.isfinite().all()), bool((picked - picked).eq(0).all()), step', 'q']\n"
        "with mock.patch('builtins.input', side_effect=commands):\n"
        "    %debug"
    ),
    "loss_fields": FIELDS + "\nprint([(f.kind, f.finite, f.untried) for f in r.fixes])\nprint(leftovers(model))",
    "defer_fails": loop("--defer"),
    "defer_fields": FIELDS + "\nprint([(f.kind, f.finite) for f in r.fixes])",
    "full_fails": loop("--full"),
    "full_fields": FIELDS + "\nprint([(f.kind, f.finite) for f in r.fixes])",
    "ops_fails": loop("--ops"),
    "ops_fields": FIELDS + "\nprint([(f.kind, f.finite) for f in r.fixes])\nprint(leftovers(model))",
    # %nanwatch on over several cells: one run, whichever cell fails.
    "watch_on": "%nanwatch on\nk = 0",
    "watch_0": ITERATION,
    "watch_status": "%nanwatch status",
    "watch_raises_interrupt": "out = model(xs, 0)\nraise KeyboardInterrupt",
    "watch_1": ITERATION,
    "watch_2": ITERATION,
    "watch_3_fails": ITERATION,
    "watch_fields": FIELDS + "\nprint(k)",
    "watch_fixed": (
        "class Fixed(Scale):\n"
        "    def forward(self, x, step):\n"
        "        return self.lin(x)\n"
        "model.body = Fixed()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)"
    ),
    "watch_rerun": ITERATION + "\nprint('finite', k, bool(loss.isfinite()))",
    "watch_two_models": OTHER + "\na = model(xs, 0)\nb = other(xs)",
    "watch_two_fields": "r = _nan_report\nprint(r.phase, r.module, r.model, r.op, r.source.lineno)",
    # A %%nantrace cell while %nanwatch on is armed: its own watch takes over for the cell, the run goes on after.
    "watch_taken_over": "%%nantrace other --defer\nb = other(xs)",
    "watch_taken_over_fields": "r = _nan_report\nprint(r.phase, r.module, r.model, r.step)\n%nanwatch status",
    # A real interrupt: the kernel gets SIGINT while the watched loop runs (the cell's timeout below).
    "watch_interrupted": (
        "while True:\n"
        "    out = model(xs, 0); loss = nn.functional.cross_entropy(out, ys)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()"
    ),
    "watch_after_interrupt": ITERATION + "\nprint('finite', bool(loss.isfinite()))",
    "watch_off": "%nanwatch off",
    "watch_gone": "print(leftovers(model, other))\n%nanwatch status",
    "nantrace_interrupted": (
        "%%nantrace\n"
        "while True:\n"
        "    out = model(xs, 0); loss = nn.functional.cross_entropy(out, ys)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()"
    ),
    "nantrace_interrupted_gone": "print(leftovers(model, other))",
    # The loop of forward_fails run again after the fix (watch_fixed): it runs through, and shows no report.
    "nantrace_rerun_fixed": loop() + "\nprint('finite', step, bool(loss.isfinite()))",
    # Bad arguments: one line each, the cell's body not run, nothing armed.
    "bad_option": "%%nantrace --bogus\nprint('ran')",
    "bad_target": "%%nantrace modle\nprint('ran')",
    "bad_non_module": "%%nantrace xs\nprint('ran')",
    "bad_kinds": "%%nantrace --kinds nam\nprint('ran')",
    "bad_output": "%%nantrace -o 1x\nprint('ran')",
    "bad_empty": "%%nantrace\n",
    "bad_subcommand": "%nanwatch of",
    "bad_watch_option": "%nanwatch on --bogus",
    "bad_status": "%nanwatch status now",
    "bad_replay_path": "%nanreplay /nonexistent/scene.pt",
    "bad_twice": "%nanwatch model\n%nanwatch model\nprint('ran')",
    "bad_gone": "print(leftovers(model, other))\n%nanwatch status\nprint('_nan_report' in dir(), _nan_report.model)",
    # --dump, for the restarted kernel.
    "dump_setup": (
        "scenes = tempfile.mkdtemp()\nmodel.body = Scale(); opt = torch.optim.SGD(model.parameters(), lr=0.01)"
    ),
    "dump_fails": loop("--dump $scenes"),
    "dump_listed": (
        "scene_path = os.path.join(scenes, sorted(os.listdir(scenes))[0])\n"
        "print(sorted(os.listdir(scenes)), scene_path)"
    ),
    "bad_replay_model": "%nanreplay $scene_path xs",
    "bad_replay_gone": "print(leftovers(model, other))",
    # A producer that fails on its weights, not on a Python argument: its scene replays to the same op.
    "dump_other": "%%nantrace other --dump $scenes\nb = other(xs)",
    "dump_other_listed": "print(_nan_report.scene)",
}
RAISING = {
    "forward_fails", "loss_fails", "defer_fails", "full_fails", "ops_fails", "watch_raises_interrupt",
    "watch_3_fails", "watch_two_models", "watch_taken_over", "watch_interrupted", "nantrace_interrupted",
    "dump_fails", "dump_other",
} | {name for name in SESSION if name.startswith("bad_") and name != "bad_gone"}
#: Cells the kernel is interrupted in (seconds after they start).
INTERRUPTED = {"watch_interrupted": 6, "nantrace_interrupted": 6}


def restarted(scene: str, other_scene: str) -> dict[str, str]:
    """A fresh kernel: the models rebuilt from the same code, the scenes the session dumped opened."""
    return {
        "setup": "%load_ext nan_magic\nimport sys\nimport torch\nfrom torch import nn\nimport nan_magic",
        "model": MODEL + "\n" + OTHER,
        "loaded": (
            f"scene = nan_magic.load_scene({scene!r})\nr = scene.report\n"
            "print(r.phase, r.module, r.op, r.step, r.source.lineno, r.source.filename)\n"
            "print([(f.kind, f.finite) for f in r.fixes])"
        ),
        "shown": "r",
        "plain": f"print(type(torch.load({scene!r}, weights_only=True)).__name__)",
        "replayed": f"%nanreplay {scene} model",
        "fixed": (
            "class Fixed(Scale):\n"
            "    def forward(self, x, step):\n"
            "        h = self.lin(x)\n"
            "        return h / (h - h).clamp_min(1e-3) if step == 3 else h\n"
            "model.body = Fixed()"
        ),
        "replayed_fixed": f"%nanreplay {scene} model",
        "cli": f"!{{sys.executable}} -m nan_magic show {scene}",
        "other_replayed": f"%nanreplay {other_scene} other",
        "other_fixed": "other[1] = Clamped()",
        "other_replayed_fixed": f"%nanreplay {other_scene} other",
    }


def execute(cells: dict[str, str], raising: set[str], path: Path, interrupted: dict[str, int] | None = None) -> Any:
    """Write ``cells`` as a notebook at ``path`` and execute it in a fresh kernel (as jupyter_support.execute_cells).

    The cells in ``interrupted`` get the kernel interrupted (SIGINT, as the stop button) that many seconds in.
    """
    import nbformat
    from nbclient import NotebookClient

    interrupted = interrupted or {}
    notebook = write_cells(cells, raising, path)
    client = NotebookClient(
        notebook, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
        timeout_func=lambda cell: interrupted.get(cell.metadata.get("name"), 300), interrupt_on_timeout=True,
    )
    client.execute(env=isolated_env(path.parent))
    nbformat.write(notebook, path)
    return notebook


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return execute(SESSION, RAISING, tmp_path_factory.mktemp("session") / "session.ipynb", INTERRUPTED)


@pytest.fixture(scope="module")
def after_restart(session: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    scene = printed(session, "dump_listed")[0].split()[-1]
    (other_scene,) = printed(session, "dump_other_listed")
    return execute(restarted(scene, other_scene), set(), tmp_path_factory.mktemp("restart") / "restart.ipynb")


def printed(nb: Any, name: str) -> list[str]:
    """The lines a cell printed (stdout)."""
    cell = named_cell(nb, name)
    return "".join(out["text"] for out in cell.outputs if out.get("name") == "stdout").splitlines()


def stderr(nb: Any, name: str) -> str:
    cell = named_cell(nb, name)
    return "".join(out["text"] for out in cell.outputs if out.get("name") == "stderr")


def error(nb: Any, name: str) -> Any:
    (found,) = [out for out in named_cell(nb, name).outputs if out.output_type == "error"]
    return found


def no_error(nb: Any, name: str) -> bool:
    return not [out for out in named_cell(nb, name).outputs if out.output_type == "error"]


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def error_lines(nb: Any, name: str) -> list[str]:
    return plain("\n".join(error(nb, name).traceback)).splitlines()


def static_report(nb: Any, name: str) -> dict[str, Any]:
    """The static report's bundle (before the widget, which must be there too: the report is alive)."""
    outputs = named_cell(nb, name).outputs
    (static,) = [i for i, out in enumerate(outputs) if "nm-static" in out.get("data", {}).get("text/html", "")]
    (widget,) = [i for i, out in enumerate(outputs) if WIDGET_MIME in out.get("data", {})]
    assert static < widget
    return dict(outputs[static]["data"])


def tab_titles(nb: Any, name: str) -> list[str]:
    """The titles of the report widget's Tab, from the stored widget state (the widget is alive)."""
    (view,) = [out["data"][WIDGET_MIME] for out in named_cell(nb, name).outputs if WIDGET_MIME in out.get("data", {})]
    tab = widget_states(nb)[view["model_id"]]
    assert tab["model_name"] == "TabModel"
    return list(tab["state"]["titles"])


def in_cell(nb: Any, name: str) -> int:
    return int(named_cell(nb, name).execution_count)


# -- %%nantrace around a loop that blows up at step 3, %debug after it ---------------------------------------


def test_the_error_names_module_op_line_phase_step_and_the_users_cells(session: Any) -> None:
    model_cell, loop_cell = in_cell(session, "model"), in_cell(session, "forward_fails")
    lines = error_lines(session, "forward_fails")
    assert lines[:2] == [
        "NonFiniteError: first non-finite value in forward step 3: body (Scale)",
        f"  op aten.div.Tensor at Cell In[{model_cell}], line 7 (17 +inf, 15 -inf of 32)",
    ], lines
    # The loop's cell (the magic is its line 1), the model's cell, and the producing line, in the user's words.
    assert lines[2:4] == [f"Cell In[{loop_cell}], line 3", "    out = model(xs, step)"], lines
    assert f"producer: Cell In[{model_cell}], line 7, in forward" in lines
    assert "    boom = h / (h - h) if step == 3 else h" in lines
    text = static_report(session, "forward_fails")["text/plain"]
    assert text.startswith("nan_magic: first non-finite value in forward step 3: body (Scale), op aten.div.Tensor "
                           f"at Cell In[{model_cell}], line 7")
    assert "Likely cause: division-by-zero." in text
    assert printed(session, "forward_fields")[0] == "forward body aten.div.Tensor 3 7 model"
    assert tab_titles(session, "forward_fails") == TAB_TITLES


def test_debug_lands_at_the_producing_line_with_its_locals(session: Any) -> None:
    shown = [plain(line) for line in printed(session, "forward_debug")]
    arrows = [line for line in shown if "---->" in line]
    # pdb's stop and where's last frame are the producing line; where's other arrows are the callers' lines.
    assert len(arrows) == 3 and "boom = h / (h - h) if step == 3 else h" in arrows[0] == arrows[-1], shown
    assert "out = model(xs, step)" in arrows[1], shown
    # h is the line's finite input, h - h its all-zero divisor; boom is what the line made.
    assert "(torch.Size([8, 4]), True, True)" in shown and "True" in shown, shown


def test_the_fix_shown_says_it_hides_the_nan_rather_than_fixing_it(session: Any) -> None:
    text = static_report(session, "forward_fails")["text/plain"]
    # (session 46: a trial through the model only is a tally of its own in the title)
    assert ("Fixes tried on a replay of step 3 (on copies: your model, optimizer and data are untouched): "
            "0 of 1 verified, 1 through the model only (no loss of its own computed)") in text
    (eps,) = [line for line in text.splitlines() if line.startswith("  eps: ")]
    # h / (h - h) makes +-inf, not NaN (x/0, h nonzero): the fix hides the inf (user-s27: it said "the NaN").
    # (session 45: the failing step stopped before its loss code; its backward from ones is said as such)
    assert "verified through the model only: its forward and a stand-in backward came out finite" in eps, eps
    assert "the inf is hidden, not fixed" in eps, eps
    assert printed(session, "forward_fields")[1] == "[('eps', 'body', True)]"


# -- split cells: the model, the loss helper and the loop in three cells -------------------------------------


def test_a_loss_helper_in_its_own_cell_is_named_by_that_cell(session: Any) -> None:
    loss_cell, loop_cell = in_cell(session, "lossfn"), in_cell(session, "loss_fails")
    lines = error_lines(session, "loss_fails")
    assert lines[:2] == [
        "NonFiniteError: first non-finite value in forward step 2: code outside any watched module",
        f"  op aten.log.default at Cell In[{loss_cell}], line 4 (8 -inf of 8)",
    ], lines
    assert lines[2:4] == [f"Cell In[{loop_cell}], line 4", "    loss = my_loss(out, ys, step)"], lines
    assert f"producer: Cell In[{loss_cell}], line 4, in my_loss" in lines
    assert printed(session, "loss_fields")[0] == "forward None aten.log.default 2 4 None"
    shown = [plain(line) for line in printed(session, "loss_debug")]
    assert any("---->" in line and "ll = torch.log(picked - picked)" in line for line in shown), shown
    assert "(True, True, 2)" in shown, shown


def test_the_loss_helpers_fixes_say_which_ran_and_which_did_not(session: Any) -> None:
    assert printed(session, "loss_fields")[1] == (
        "[('eps', True, None), ('stable', None, \"it found nothing to change at the producer's line\")]")
    text = static_report(session, "loss_fails")["text/plain"]
    assert "1 of 2 verified" in text
    assert f"suggested edit (not applied): Cell In[{in_cell(session, 'lossfn')}], line 4: " \
           "ll = torch.log((picked - picked).clamp_min(1.2e-07))" in text


# -- the other timings and modes ------------------------------------------------------------------------------


@pytest.mark.parametrize("cell", ["forward_fails", "defer_fails", "full_fails", "ops_fails"])
def test_every_mode_names_the_same_producer(session: Any, cell: str) -> None:
    model_cell = in_cell(session, "model")
    assert error_lines(session, cell)[:1] == ["NonFiniteError: first non-finite value in forward step 3: body (Scale)"]
    assert error_lines(session, cell)[1].startswith(f"  op aten.div.Tensor at Cell In[{model_cell}], line 7 (")
    fields = cell.replace("_fails", "_fields")
    assert printed(session, fields)[0] == "forward body aten.div.Tensor 3 7 model"


def test_the_deferred_check_tries_the_same_fix(session: Any) -> None:
    assert printed(session, "defer_fields")[1] == "[('eps', True)]"


@pytest.mark.parametrize("cell", ["full", "ops"])
def test_full_and_ops_modes_try_the_same_fix(session: Any, cell: str) -> None:
    # mode="full" and ops=True keep the step's model calls too (localize/modes.py kept): the remedy is tried on a
    # replay of the failing call, as the default watch tries it, and shown in the text and in the widget.
    assert printed(session, f"{cell}_fields")[1] == "[('eps', True)]"
    text = static_report(session, f"{cell}_fails")["text/plain"]
    assert "Fixes tried" in text and "no fix was tried" not in text, text
    states = widget_states(session)
    (view,) = [out["data"][WIDGET_MIME] for out in named_cell(session, f"{cell}_fails").outputs
               if WIDGET_MIME in out.get("data", {})]
    models, todo = [], [states[view["model_id"]]]
    while todo:  # the report widget's models, all the way down
        models.append(model := todo.pop())
        todo.extend(states[ref.removeprefix("IPY_MODEL_")] for ref in model["state"].get("children", []))
    assert not any("no fix was tried" in model["state"].get("value", "") for model in models
                   if model["model_name"] == "HTMLModel")
    assert any("verified" in model["state"].get("value", "") for model in models
               if model["model_name"] == "HTMLModel")


# -- %nanwatch on over several cells ---------------------------------------------------------------------------


def test_nanwatch_on_counts_one_run_across_cells_and_an_interrupted_cell(session: Any) -> None:
    assert printed(session, "watch_on") == ["nan_magic: watching every cell (every module called) until %nanwatch off"]
    # (and the last report, the ops_fails cell's, past the cells after it: round 20, it forgot it)
    assert printed(session, "watch_status") == [
        "nan_magic: on for every cell (all targets)", "last report: " + error(session, "ops_fails").evalue]
    assert error(session, "watch_raises_interrupt").ename == "KeyboardInterrupt"
    for name in ("watch_0", "watch_1", "watch_2"):
        assert no_error(session, name)
    # k == 3 iterations ran (one per cell), the interrupted cell's forward-only call among them: the 4th is step 3.
    lines = error_lines(session, "watch_3_fails")
    assert lines[0] == "NonFiniteError: first non-finite value in forward step 3: body (Scale)"
    assert lines[2] == f"Cell In[{in_cell(session, 'watch_3_fails')}], line 1"
    assert printed(session, "watch_fields") == ["forward body aten.div.Tensor 3 7 model", "3"]


def test_a_cell_rerun_after_a_fix_and_a_changed_model_run_on_under_the_watch(session: Any) -> None:
    assert no_error(session, "watch_fixed")
    assert printed(session, "watch_rerun") == ["finite 4 True"]


def test_two_models_the_report_names_the_one_that_failed(session: Any) -> None:
    cell = in_cell(session, "watch_two_models")
    lines = error_lines(session, "watch_two_models")
    assert lines[:2] == [
        "NonFiniteError: first non-finite value in forward step 1: 1 (LogLayer) in other",
        f"  op aten.log.default at Cell In[{cell}], line 3 (32 nan of 32)",
    ], lines
    assert printed(session, "watch_two_fields") == ["forward 1 other aten.log.default 3"]


def test_a_nantrace_cell_takes_over_from_nanwatch_on_for_its_cell(session: Any) -> None:
    lines = error_lines(session, "watch_taken_over")
    # One model watched (the cell's target): the headline names no model.
    assert lines[0] == "NonFiniteError: first non-finite value in forward step 0: 1 (LogLayer)", lines
    assert printed(session, "watch_taken_over_fields") == [
        "forward 1 other 0", "nan_magic: on for every cell (all targets)",
        "last report: " + error(session, "watch_taken_over").evalue]


def test_an_interrupt_from_the_kernel_leaves_the_run_going_and_nothing_behind(session: Any) -> None:
    assert error(session, "watch_interrupted").ename == "KeyboardInterrupt"
    assert printed(session, "watch_after_interrupt") == ["finite True"]
    assert printed(session, "watch_off") == ["nan_magic: watch off"]
    # The status names the last report (the %%nantrace cell's) past the cells after it (round 20: it forgot it)
    assert printed(session, "watch_gone") == [
        "[]", "nan_magic: off", "last report: " + error(session, "watch_taken_over").evalue]
    assert error(session, "nantrace_interrupted").ename == "KeyboardInterrupt"
    assert printed(session, "nantrace_interrupted_gone") == ["[]"]


def test_the_loop_rerun_after_the_fix_runs_through_and_shows_no_report(session: Any) -> None:
    assert printed(session, "nantrace_rerun_fixed") == ["finite 5 True"]
    outputs = named_cell(session, "nantrace_rerun_fixed").outputs
    assert [out.output_type for out in outputs] == ["stream"], outputs


# -- bad input to every magic ----------------------------------------------------------------------------------

#: (Round 21: an unknown option's line names the options, an abbreviation is one.)
WATCH_OPTIONS = (
    "; the options are --defer, --dump, --exclude, --full, --include, --keep-last-good, --kinds, --log, --log-file, "
    "--no-backward, --no-fixes, --no-replay, --ops, --output, --quiet, --types, --warn"
)
BAD = {
    "bad_option": "UsageError: %%nantrace: unrecognized arguments: --bogus" + WATCH_OPTIONS,
    "bad_target": "UsageError: %%nantrace: cannot evaluate target 'modle': name 'modle' is not defined",
    "bad_non_module": "UsageError: %%nantrace: cannot watch xs (torch.Tensor): "
                      "expected an nn.Module, a torch.optim.Optimizer or a GradScaler",
    "bad_kinds": "UsageError: %%nantrace: kinds must be a non-empty subset of {'nan', 'inf'}, not ['nam']",
    "bad_output": "UsageError: %%nantrace: -o needs a Python identifier, not '1x'",
    "bad_empty": "UsageError: %%nantrace is a cell magic, but the cell body is empty.",
    "bad_subcommand": "UsageError: %nanwatch: 'of' is not on, off or status, nor a name defined here "
                      "(the models, optimizers or GradScalers to watch)",
    "bad_watch_option": "UsageError: %nanwatch: unrecognized arguments: --bogus" + WATCH_OPTIONS,
    "bad_status": "UsageError: %nanwatch status takes no arguments",
    "bad_replay_path": "UsageError: %nanreplay: cannot read /nonexistent/scene.pt: "
                       "[Errno 2] No such file or directory: '/nonexistent/scene.pt'",
    "bad_twice": "UsageError: %nanwatch: a watch is already armed for this cell",
    "bad_replay_model": "UsageError: %nanreplay: xs is not an nn.Module",
}


@pytest.mark.parametrize("cell", sorted(BAD))
def test_bad_input_is_one_clear_line_and_runs_nothing(session: Any, cell: str) -> None:
    assert stderr(session, cell) == BAD[cell] + "\n"
    assert printed(session, cell) == []  # the body's print('ran') never ran
    assert no_error(session, cell)  # a usage error, not a traceback


def test_after_bad_input_nothing_is_armed_or_left_and_the_last_report_is_kept(session: Any) -> None:
    assert printed(session, "bad_gone") == [
        "[]", "nan_magic: off", "last report: " + error(session, "watch_taken_over").evalue, "True other"]
    assert printed(session, "bad_replay_gone") == ["[]"]


# -- after a kernel restart: the dumped scene -------------------------------------------------------------------


def test_a_scene_opened_after_a_restart_shows_the_report_alive_and_compact(session: Any, after_restart: Any) -> None:
    model_cell = in_cell(session, "model")
    lines = printed(after_restart, "loaded")
    assert lines[0].startswith("forward body aten.div.Tensor 3 7 ")
    assert lines[1] == "[('eps', True)]"
    outputs = named_cell(after_restart, "shown").outputs
    assert not [out for out in outputs if out.output_type == "error"]
    static = static_report(after_restart, "shown")
    assert "Traceback" not in static["text/plain"] and "%debug" not in static["text/plain"].split("\n\n")[0]
    assert "0 of 1 verified, 1 through the model only" in static["text/plain"]
    assert tab_titles(after_restart, "shown") == TAB_TITLES
    assert printed(after_restart, "plain") == ["dict"]
    cli = "\n".join(printed(after_restart, "cli"))
    assert cli.startswith("nan_magic: first non-finite value in forward step 3: body (Scale), op aten.div.Tensor")
    # The cell the model was defined in, not the dead kernel's temporary file.
    for text in (static["text/plain"], cli):
        assert f"at Cell In[{model_cell}], line 7" in text and "ipykernel_" not in text


def test_a_scene_replays_on_the_rebuilt_model_and_says_when_a_fix_holds(after_restart: Any) -> None:
    # The log line of the restarted kernel's cell (the model cell holds MODEL, then OTHER).
    line = MODEL.count("\n") + 1 + OTHER.splitlines().index("        return torch.log(x)") + 1
    assert printed(after_restart, "other_replayed") == [
        f"nan_magic: replay of 1 reproduced 32 nan in aten.log.default at Cell In[{in_cell(after_restart, 'model')}], "
        f"line {line}, in forward"]
    (fixed,) = printed(after_restart, "other_replayed_fixed")
    assert fixed.startswith("nan_magic: replay of ") and " stayed finite" in fixed, fixed


def test_a_scene_replays_a_call_with_a_python_argument(after_restart: Any) -> None:
    # model(xs, step) replayed as model(xs), step=0, and %nanreplay said it stayed finite: the scene keeps a call's
    # plain Python arguments now (scene/dump.py _producer_call).
    # (The xfail asked for words no replay line writes: a replay's line is replay_line's, as the test above reads.)
    model_cell = in_cell(after_restart, "model")
    (line,) = printed(after_restart, "replayed")
    assert line.startswith("nan_magic: replay of body reproduced ") and (
        f" in aten.div.Tensor at Cell In[{model_cell}], line 7, in forward") in line, line
    (fixed,) = printed(after_restart, "replayed_fixed")
    assert fixed.startswith("nan_magic: replay of ") and " stayed finite" in fixed, fixed
