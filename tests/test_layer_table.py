"""The Layers table is the failing step's module tree: every module, the producer's path marked, gaps said."""

from __future__ import annotations

import re
from functools import cache
from html import unescape

import torch
from test_render import HalfAttention
from torch import nn
from watching import raised

from nan_magic import Phase, Report, TensorRef, TensorRole, load_scene
from nan_magic.render.history_layers import TOP_LAYERS
from nan_magic.scene.dump import SCENE_VERSION


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = HalfAttention()
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.spare = nn.Linear(16, 16)  # registered, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x * 30 + self.pre(x)))


#: Every module of Net in the order a forward calls them (``spare`` where it is registered).
MODULES = [
    "", "pre", "pre.0", "pre.1", "blocks",
    *(f"blocks.{i}{part}" for i in (0, 1) for part in (
        "", ".attn", ".attn.qkv", ".attn.proj", ".mlp", ".mlp.0", ".mlp.1", ".mlp.2", ".spare")),
    "head",
]


@cache
def net_report(mode: str) -> Report:
    torch.manual_seed(1)
    model = Net().half()
    x = torch.randn(2, 8, 16).half()
    x[1, 3] = 40.0  # one token far larger than the rest
    return raised(lambda: model(x), model, mode=mode)


def modules_in_order(report: Report) -> list[str]:
    return list(dict.fromkeys(report.table["module"]))


def status_cells(html: str) -> dict[str, set[str]]:
    """module label -> the status texts of its rows in the report's HTML table."""
    html = re.search(r'<table[^>]*nm-layers.*?</table>', html, re.S).group(0)  # type: ignore[union-attr]
    rows = re.findall(r"<tr>(.*?)</tr>", html, re.S)[1:]
    header = re.findall(r'<th [^>]*class="col_heading[^"]*"[^>]*>([^<]*)</th>', html)
    found: dict[str, set[str]] = {}
    for row in rows:
        cells = dict(zip(header, re.findall(r'<td class="[^"]*" >([^<]*)</td>', row)))
        found.setdefault(cells["module"], set()).add(cells["status"])
    return found


def test_replayed_step_lists_every_module_with_its_numbers() -> None:
    report = net_report("tiered")
    assert report.module == "blocks.0.attn" and report.op == "aten.bmm.default"
    table = report.table
    assert modules_in_order(report) == MODULES
    # The replay ran the step to its end: the modules after the producer have numbers (NaN carried on).
    head = table[table["module"] == "head"].iloc[0]
    assert head["status"] == "propagated" and head["nan"] > 0 and head["shape"] == (2, 8, 4)
    # A ReLU with a finite input, which the watch passes through unmeasured, is measured by the replay.
    relu = table[table["module"] == "pre.1"].iloc[0]
    assert relu["status"] == "ok" and relu["min"] == 0 and relu["max"] > 0
    # A module the step never called says so, with no numbers (not zeros).
    spare = table[table["module"] == "blocks.0.spare"].iloc[0]
    assert spare["status"] == "not called" and spare[["min", "max", "nan"]].isna().all()
    # Parents come before their children, in the order the calls began.
    calls = table["call"].dropna().tolist()
    assert calls == sorted(calls)


def test_producer_and_its_parents_are_marked_in_every_view() -> None:
    report = net_report("tiered")
    statuses = status_cells(report.to_html())
    for parent in ("blocks (Sequential)", "blocks.0 (Block)"):
        assert statuses[parent] == {"contains producer"}, parent
    assert statuses["Net (root)"] == {"contains producer", "ok"}  # its forward, and the batch entering it
    assert statuses["blocks.0.attn (HalfAttention)"] == {"producer"}
    assert statuses["blocks.0.attn.qkv (Linear)"] == {"ok"}
    assert statuses["blocks.1 (Block)"] == {"propagated"}
    assert statuses["blocks.0.spare (Linear)"] == {"not called"}
    assert "not called: the step ran to its end without calling it" in report.to_html()
    text = report.to_text()
    # Indented by depth, as in the HTML table.
    assert re.search(r"^ +6  contains producer +16 +0 +0 {6}blocks\.0 \(Block\)", text, re.M)
    assert re.search(r"^ +0  contains producer +32 +0 +0  Net \(root\)", text, re.M)
    assert re.search(r"^>.*producer.*blocks\.0\.attn \(HalfAttention\)", text, re.M)
    assert f"Layers of step 0: {report.table['call'].nunique()} calls measured; 2 not called" in text


def test_a_raising_full_watch_lists_the_modules_it_did_not_reach() -> None:
    report = net_report("full")
    assert report.module == "blocks.0.attn"
    table = report.table
    assert modules_in_order(report) == MODULES
    forward = table[table["phase"] == "forward"]
    status = dict(zip(forward["module"], forward["status"]))
    # The step stopped at the event: its parents were still running, and what comes after never ran.
    assert [status[name] for name in ("", "blocks", "blocks.0")] == ["running"] * 3
    assert {status[name] for name in MODULES[MODULES.index("blocks.0.mlp"):]} - {"unchecked"} == {"not reached"}
    # The ReLUs pass finite values through unmeasured under the full watch: said, not shown as zeros.
    assert status["pre.1"] == "unchecked" and table[table["module"] == "pre.1"]["max"].isna().all()
    html = report.to_html()
    assert "not reached: the report was made before it ran" in html
    assert status_cells(html)["blocks (Sequential)"] == {"contains producer"}


def test_history_shows_the_layer_magnitudes_of_the_per_module_steps(tmp_path) -> None:
    torch.manual_seed(1)
    model = Net().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay put: step 1's values can be checked
    batches = [torch.randn(2, 8, 16).half() for _ in range(4)]
    batches[3][1, 3] = 40.0

    def train() -> None:
        for x in batches:
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(train, model, opt, dump=str(tmp_path))
    producer = report.module
    assert report.step == 3 and producer in ("blocks.0.attn", "blocks.1.attn")
    # The watch's second step checked every module; it kept a few floats per module, and the other steps none.
    assert [entry.step for entry in report.history if entry.full] == [1]
    assert all(not entry.layers for entry in report.history if not entry.full)
    kept = {name: value for name, value, _dtype, _path in report.history[1].layers}
    assert {name: path for name, _value, _dtype, path in report.history[1].layers}["blocks.0.attn.qkv"] == (
        "blocks", "0", "attn", "qkv")
    # Every module called, but the ReLUs: with a finite input, they pass it through unmeasured (transparent.py).
    relus = {"pre.1", "blocks.0.mlp.1", "blocks.1.mlp.1"}
    assert set(kept) == {name for name in MODULES if "spare" not in name} - relus
    with torch.no_grad():
        qkv = model.blocks[0].attn.qkv(batches[1] * 30 + model.pre(batches[1]))
    assert kept["blocks.0.attn.qkv"] == qkv.abs().max().item()
    html = report.to_html()
    assert "Step 1 measured every module&#x27;s output (a per-module step)" in html
    assert re.search(rf"<li>The producer, {re.escape(producer)}, on the per-module steps: step 1: "
                     r"max \|output\| [\d.]+, headroom [\d,]+x \(float16\)</li>", html)
    # The largest layers first, each with its number and how far it is from float16's limit.
    largest = max(kept.values())
    assert re.search(rf"<li>[\w.]+: max \|output\| {largest:.4g}, headroom {65504 / largest:,.0f}x \(float16\)</li>",
                     html)
    # A parent that only returns its child's value is left out, its child listed: blocks returns blocks.1's.
    assert "<li>blocks.1: max |output|" in html and "<li>blocks: " not in html
    # A version 4 scene kept each layer as (module, value, dtype): its History names the same layers.
    data = torch.load(report.scene, weights_only=True)
    for entry in data["report"]["history"]:
        entry["layers"] = tuple(layer[:3] for layer in entry["layers"])
    data["version"] = 4
    torch.save(data, tmp_path / "version_4_scene.pt")
    older = load_scene(tmp_path / "version_4_scene.pt").report
    assert older.history == load_scene(report.scene).report.history
    assert history_lines(older.to_html()) == history_lines(html)
    assert len(history_lines(html)) == TOP_LAYERS + 1  # the largest layers, and the producer's line


def history_lines(html: str) -> list[str]:
    """The HTML report's History items about the per-module steps' layers."""
    return re.findall(r"<li>[^<]*max \|output\|[^<]*</li>", html)


def test_a_module_left_out_by_exclude_is_not_measured() -> None:
    torch.manual_seed(1)
    model = Net().half()
    x = torch.randn(2, 8, 16).half()
    x[1, 3] = 40.0
    report = raised(lambda: model(x), model, mode="full", exclude=["head"])
    status = dict(zip(report.table["module"], report.table["status"]))
    assert status["head"] == "not measured"
    assert "a module the include, exclude or types options leave out" in report.to_html()


def test_each_row_holds_its_module_s_place_in_the_model_and_an_older_scene_s_tree_still_shows(tmp_path) -> None:
    """The tree is drawn from each row's path (the names from the root down), not from the dots of its name."""
    torch.manual_seed(1)
    model = Net().half()
    x = torch.randn(2, 8, 16).half()
    x[1, 3] = 40.0
    report = raised(lambda: model(x), model, dump=str(tmp_path))
    paths = {row.module: row.path for row in report.layers}
    assert paths[""] == () and paths["blocks"] == ("blocks",) and paths["blocks.1.spare"] == ("blocks", "1", "spare")
    assert paths["blocks.0.attn.qkv"] == ("blocks", "0", "attn", "qkv")
    data = torch.load(report.scene, weights_only=True)  # still plain data: no class named in the file
    assert data["version"] == SCENE_VERSION and all(isinstance(row["path"], tuple) for row in data["report"]["layers"])
    scene = load_scene(report.scene)
    # A version 4 scene stored no path: its loader reads the rows' places from their names, and draws the same tree.
    for row in data["report"]["layers"]:
        del row["path"]
    data["version"] = 4
    torch.save(data, tmp_path / "version_4_scene.pt")
    older = load_scene(tmp_path / "version_4_scene.pt")
    assert older.report.layers == scene.report.layers
    tree = layer_lines(scene.report.to_text())
    assert layer_lines(older.report.to_text()) == tree
    assert any(re.search(r" {8}blocks\.0\.attn\.qkv \(Linear\)", line) for line in tree)
    assert statuses_of(older.report)["blocks.0 (Block)"] == {"contains producer"}


def layer_lines(text: str) -> list[str]:
    """The text report's layer table: the lines from its header to the end (it comes last)."""
    lines = text.splitlines()
    return lines[next(index for index, line in enumerate(lines) if line.startswith("Layers of step")):]


def statuses_of(report: Report) -> dict[str, set[str]]:
    return status_cells(report.to_html())


class Pair(nn.Module):
    """Two outputs, the second from a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, h * mask


class PairNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a, b = self.pair(x, mask=mask)
        return self.head(a + b).sqrt()  # a zero head: sqrt(0)'s gradient is inf, and inf * 0 NaN


def test_each_row_names_its_tensor_by_a_typed_reference_and_an_older_scene_s_words_still_show(tmp_path) -> None:
    torch.manual_seed(0)
    model = PairNet()
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
    x, mask = torch.randn(3, 4), torch.ones(3, 4)
    report = raised(lambda: model(x, mask=mask).sum().backward(), model, mode="full", dump=str(tmp_path))
    rows = [(row.phase, row.module, row.tensor) for row in report.layers]
    assert rows == [
        (Phase.FORWARD, "", TensorRef.output()),
        (Phase.DATA, "", TensorRef.argument("input[0]")),
        (Phase.FORWARD, "pair", TensorRef.output("output[0]")),
        (Phase.FORWARD, "pair", TensorRef.output("output[1]")),
        (Phase.FORWARD, "pair.fc", TensorRef.output()),
        (Phase.FORWARD, "head", TensorRef.output()),
        (Phase.DATA, "", TensorRef.argument("kwargs['mask']")),
        (Phase.FORWARD, None, TensorRef(TensorRole.LOSS)),
        (Phase.BACKWARD, None, TensorRef(TensorRole.OUTPUT_GRADIENT, "", "output")),
        (Phase.BACKWARD, "", TensorRef(TensorRole.OUTPUT_GRADIENT, "head", "output")),
    ]
    # What every view shows of them: the same words in the table, the text and the HTML.
    words = ["output", "input[0]", "output[0]", "output[1]", "output", "output", "kwargs['mask']", "loss",
             "grad of model output", "grad of head output"]
    assert list(report.table["tensor"]) == words
    assert [line.split("  ")[0] for line in tensor_cells(report.to_text())] == words
    assert html_cells(report.to_html(), "tensor") == words
    # A scene keeps each reference as plain data; a version 5 scene kept the words, shown as they were written.
    data = torch.load(report.scene, weights_only=True)
    assert data["version"] == SCENE_VERSION and data["report"]["layers"][1]["tensor"] == {
        "role": "input", "name": None, "path": "input[0]", "before": False}
    assert load_scene(report.scene).report.layers == report.layers
    for row, word in zip(data["report"]["layers"], words):
        row["tensor"] = word
    data["version"] = 5
    torch.save(data, tmp_path / "version_5_scene.pt")
    older = load_scene(tmp_path / "version_5_scene.pt").report
    assert [row.said for row in older.layers] == words and all(row.tensor is None for row in older.layers)
    assert list(older.table["tensor"]) == words
    assert tensor_cells(older.to_text()) == tensor_cells(report.to_text())
    assert html_cells(older.to_html(), "tensor") == words


def html_cells(html: str, column: str) -> list[str]:
    """The cells of one column of the report's HTML layer table, as the reader sees them."""
    table = re.search(r'<table[^>]*nm-layers.*?</table>', html, re.S).group(0)  # type: ignore[union-attr]
    header = re.findall(r'<th [^>]*class="col_heading[^"]*"[^>]*>([^<]*)</th>', table)
    rows = [dict(zip(header, re.findall(r'<td class="[^"]*" >([^<]*)</td>', row)))
            for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]]
    return [unescape(row[column]) for row in rows]


def tensor_cells(text: str) -> list[str]:
    """The text layer table's cells from the tensor column on, one per row."""
    lines = layer_lines(text)
    start = next(line for line in lines if " tensor " in line).index(" tensor ") + 1
    return [line[start:].strip() for line in lines if re.match(r"[> ] +\d+ ", line)]


class _RootOfAbs(nn.Module):
    """|h| ** 0.5: finite forward at h = 0, an infinite derivative there (its backward's 0 * inf is NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).abs().pow(0.5)


def test_a_gradient_after_the_producer_that_the_probe_saw_nan_in_is_no_ok_row() -> None:
    # The gradients below the producer were freed before the report: the probe saw NaN in them, uncounted
    # ("? nan"), and the Layers tab still called them "ok".
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), _RootOfAbs(), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def train() -> None:
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    net[2].lin.weight.zero_()
                    net[2].lin.bias.zero_()
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(train, net, opt)
    assert (report.phase, report.module, report.op, report.step) == ("backward", "2", "aten.pow.Tensor_Scalar", 2)
    after = [layer for layer in report.layers if str(layer.phase) == "backward" and layer.module in ("2.lin", "1")]
    assert after and all(layer.stats is not None and layer.stats.nan is None for layer in after)
    assert [layer.status for layer in after] == ["propagated"] * len(after)
    rows = [line for line in report.to_text().splitlines() if " ? " in line]
    assert rows and not any(" ok " in row for row in rows), rows
