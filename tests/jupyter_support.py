"""Helpers for the kernel-level and browser-level tests.

* :func:`execute_notebook` runs a notebook in a real kernel with nbclient,
  keeping the widget state (``store_widget_state`` stays on: with it off,
  nbclient 0.11 fails on Output widgets).
* :func:`jupyterlab` starts JupyterLab on 127.0.0.1 with throw-away config
  and data dirs; :func:`chromium_page` drives headless Chromium through
  Playwright with every request not to 127.0.0.1 aborted.
* :func:`walk_fixtures` gives a walk's browser tests their ``lab`` and
  ``page`` fixtures.
* :func:`chromium_or_skip` skips a browser test when Chromium or Playwright
  is missing, and fails it instead when ``REQUIRE_BROWSER=1`` (CI sets it),
  so a CI run can never go green by skipping.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]


#: A test kernel's one startup file: the fix trials' time budget (fixes/runner.py) is wall time, lifted in every
#: test kernel as conftest.py's ``unhurried_fix_trials`` lifts it in-process, so that a loaded CI machine cannot
#: leave untried a remedy the tests expect verified (a fresh kernel's first trial pays the imports). Nothing is left
#: in the user's namespace; a kernel without nan_magic (a bare environment) skips it.
UNHURRIED_STARTUP = """\
try:
    from nan_magic.fixes import runner as _nan_magic_runner
except ImportError:
    pass
else:
    _nan_magic_runner.MIN_BUDGET = 600.0
    del _nan_magic_runner
"""


def isolated_env(home: Path) -> dict[str, str]:
    """Environment with Jupyter and IPython config pointed into ``home``.

    The user's profile (startup files, extensions, settings) must not change
    what a test sees; kernelspecs and lab extensions still come from the
    environment's prefix, which Jupyter searches regardless. The profile
    there starts only :data:`UNHURRIED_STARTUP`.
    """
    env = dict(os.environ)
    for variable, name in (
        ("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython"),
    ):
        path = home / name
        path.mkdir(parents=True, exist_ok=True)
        env[variable] = str(path)
    startup = home / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-unhurried-fix-trials.py").write_text(UNHURRIED_STARTUP)
    # debugpy warns about frozen modules on every kernel start; the noise
    # would land in the cells' stderr.
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    return env


# -- kernel level ------------------------------------------------------------------


def execute_notebook(path: Path, timeout: int = 300) -> Any:
    """Execute the notebook at ``path`` in a fresh python3 kernel; return it.

    Cells tagged ``raises-exception`` may fail (nbclient then records the
    error and goes on); any other error raises ``CellExecutionError``.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="nan-magic-nb-") as scratch:
        client = NotebookClient(
            nb, timeout=timeout, kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute(env=isolated_env(Path(scratch)))
    return nb


def write_cells(cells: dict[str, str], raising: set[str], path: Path) -> Any:
    """Write ``cells`` (each named by its key in the cell's metadata) as a notebook at ``path``; return it.

    The cells named in ``raising`` are tagged ``raises-exception``: their error is recorded, and the run goes on.
    """
    import nbformat

    notebook = nbformat.v4.new_notebook()
    for name, source in cells.items():
        cell = nbformat.v4.new_code_cell(source, metadata={"name": name})
        if name in raising:
            cell.metadata["tags"] = ["raises-exception"]
        notebook.cells.append(cell)
    nbformat.write(notebook, path)
    return notebook


def execute_cells(cells: dict[str, str], raising: set[str], path: Path) -> Any:
    """:func:`write_cells`, then execute the notebook in a fresh kernel; return it executed."""
    write_cells(cells, raising, path)
    return execute_notebook(path)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_copy(walk: Path, name: str, tmp_path: Path) -> Any:
    """Execute a copy of notebook ``walk / name`` in ``tmp_path`` (the walk's notebook stays as committed)."""
    shutil.copy(walk / name, tmp_path / name)
    return execute_notebook(tmp_path / name)


def cell_text(cell: Any) -> str:
    """What an executed cell showed as text: its streams, error tracebacks and plain-text data, without colours."""
    parts, last_stream = [], None
    for output in cell.outputs:
        if output.output_type == "stream" and output.name == last_stream:
            parts[-1] += output.text  # one print the kernel flushed in two messages (a loaded machine): one text
        elif output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type == "error":
            parts.append("\n".join(output.traceback))
        else:
            parts.append(output.get("data", {}).get("text/plain", ""))
        last_stream = output.name if output.output_type == "stream" else None
    return _ANSI.sub("", "\n".join(parts))


def named_cell(nb: Any, name: str) -> Any:
    """The cell of an :func:`execute_cells` notebook named ``name``."""
    (cell,) = [cell for cell in nb.cells if cell.metadata["name"] == name]
    return cell


def widget_states(nb: Any) -> dict[str, Any]:
    """Every stored widget model of an executed notebook, by model id."""
    return dict(nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"])


def short_error(cell: Any) -> list[str]:
    """The lines of the cell's error output: what stands under the cell above the report."""
    (error,) = [output for output in cell.outputs if output.output_type == "error"]
    assert error.ename == "NonFiniteError"
    return cell_text(type(cell)(outputs=[error])).splitlines()


def report_text(cell: Any) -> str:
    """The report's text as a frontend without widgets shows it (the static twin's text/plain)."""
    return "\n".join(output.data["text/plain"] for output in cell.outputs
                     if output.output_type == "display_data" and "text/html" in output.data)


def unwatched_truth(text: str) -> list[str]:
    """The fields of the ``unwatched | a | b ...`` line a notebook's own unwatched run printed (in ``text``): what a
    report whose facts hang on this machine's rounding is checked against, in the same kernel."""
    (line,) = [line for line in text.splitlines() if line.startswith("unwatched |")]
    return line.split(" | ")[1:]


def printed(cell: Any) -> str:
    """What the cell printed, its words joined by single spaces (ipykernel 5 may split one print in two streams)."""
    return " ".join(cell_text(cell).split())


def one_line_usage_error(cell: Any, start: str) -> None:
    (usage,) = cell_text(cell).strip().splitlines()
    assert usage.startswith(start), usage


# -- browser level -------------------------------------------------------------------


def chromium_or_skip() -> str:
    """Path of a Chromium for Playwright; skip (or fail under REQUIRE_BROWSER=1)."""
    reason = ""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        reason = "the playwright Python package is not installed"
    executable = next(filter(None, (shutil.which(name) for name in CHROMIUM_CANDIDATES)), None)
    if executable is None:
        reason = reason or "no Chromium found (apt-get install chromium)"
    if reason:
        if os.environ.get("REQUIRE_BROWSER") == "1":
            pytest.fail(f"REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    assert executable is not None
    return executable


@dataclass(frozen=True)
class LabServer:
    """A running JupyterLab: where it listens and what it serves."""

    port: int
    token: str
    root: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def notebook_url(self, name: str) -> str:
        """A fresh workspace per URL, so Lab does not reopen earlier notebooks."""
        return f"{self.base}/lab/workspaces/t{secrets.token_hex(4)}/tree/{name}?token={self.token}"

    def api(self, path: str, method: str = "GET") -> Any:
        request = urllib.request.Request(
            f"{self.base}{path}", method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def jupyterlab(root: Path, home: Path, startup_timeout: float = 90.0) -> Iterator[LabServer]:
    """Run JupyterLab on loopback serving ``root``; stop it and its kernels after."""
    server = LabServer(_free_port(), secrets.token_hex(16), root)
    # No "get notified about Jupyter news?" toast over the notebook.
    settings = home / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    log_path = home / "jupyterlab.log"
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
        "--ip=127.0.0.1", f"--port={server.port}", "--port-retries=0",
        f"--IdentityProvider.token={server.token}", f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, env=isolated_env(home), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_until_up(server, process, log_path, startup_timeout)
        yield server
    finally:
        _stop(server, process)


def _wait_until_up(server: LabServer, process: subprocess.Popen[bytes], log: Path,
                   timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited early:\n{log.read_text(errors='replace')}")
        try:
            server.api("/api/status")
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.3)
    raise RuntimeError(
        f"JupyterLab did not answer in {timeout} s:\n{log.read_text(errors='replace')}"
    )


def _stop(server: LabServer, process: subprocess.Popen[bytes]) -> None:
    # Kernels run in sessions of their own: shut them down through the
    # server before stopping the server's own process group.
    try:
        for kernel in server.api("/api/kernels"):
            server.api(f"/api/kernels/{kernel['id']}", method="DELETE")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        pass
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


@contextmanager
def chromium_page(executable: str) -> Iterator[Any]:
    """A headless Chromium page that may only reach 127.0.0.1."""
    from playwright.sync_api import sync_playwright

    def local_only(route: Any) -> None:
        url = urlparse(route.request.url)
        if url.scheme in ("data", "blob") or url.hostname == "127.0.0.1":
            route.continue_()
        else:
            route.abort()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS,
        )
        try:
            context = browser.new_context(viewport={"width": 1500, "height": 1000})
            context.route("**/*", local_only)
            yield context.new_page()
        finally:
            browser.close()


def open_and_run_all(page: Any, server: LabServer, name: str, timeout_ms: int = 120_000) -> None:
    """Open notebook ``name`` in Lab, wait for an idle kernel, run all cells."""
    page.goto(server.notebook_url(name))
    # The status bar's "Python 3 (ipykernel) | Idle" appears once the kernel
    # really started; the toolbar indicator reads idle before that.
    page.get_by_text(re.compile(r"Python 3.*\| Idle")).first.wait_for(timeout=timeout_ms)
    # Run All is disabled until the notebook is the current widget; clicking
    # a disabled menu item would silently do nothing.
    page.locator(".jp-Notebook .jp-Cell").first.click()
    page.locator("li.lm-MenuBar-item", has_text="Run").first.click()
    page.locator(
        'li.lm-Menu-item[data-command="runmenu:run-all"]:not(.lm-mod-disabled)'
    ).click()


def save_restart_and_reopen(page: Any, server: LabServer, name: str) -> None:
    """Save the open notebook in Lab, restart every kernel, open it again: what a reader finds next time."""
    page.keyboard.press("Control+s")
    page.get_by_text(re.compile(r"Saving completed|Saved")).first.wait_for(timeout=30_000)
    for kernel in server.api("/api/kernels"):
        server.api(f"/api/kernels/{kernel['id']}/restart", method="POST")
    page.goto(server.notebook_url(name))
    page.get_by_text(re.compile(r"Python 3.*\| Idle")).first.wait_for(timeout=120_000)


def coloured_pixels(image: Any) -> int:
    """How many pixels of a rendered ``<img>`` are clearly not grey."""
    return int(image.evaluate(
        """(img) => {
            const canvas = document.createElement('canvas');
            canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
            const context = canvas.getContext('2d');
            context.drawImage(img, 0, 0);
            const data = context.getImageData(0, 0, canvas.width, canvas.height).data;
            let count = 0;
            for (let i = 0; i < data.length; i += 4) {
                const [r, g, b] = [data[i], data[i + 1], data[i + 2]];
                if (Math.max(r, g, b) - Math.min(r, g, b) > 60) count++;
            }
            return count;
        }"""
    ))


@contextmanager
def lab_with(walk: Path, names: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """JupyterLab serving copies of ``names`` from the notebook folder ``walk`` (skips without Chromium)."""
    chromium_or_skip()
    root = tmp_path_factory.mktemp("lab-root")
    for name in names:
        shutil.copy(walk / name, root / name)
    with jupyterlab(root, tmp_path_factory.mktemp("lab-home")) as server:
        yield server


@contextmanager
def screenshot_page(test_name: str) -> Iterator[Any]:
    """A Chromium page, its screenshot written to test-artifacts/ when the test ends."""
    ARTIFACTS.mkdir(exist_ok=True)
    with chromium_page(chromium_or_skip()) as browser_page:
        yield browser_page
        browser_page.screenshot(path=str(ARTIFACTS / f"{test_name}-page.png"))


def walk_fixtures(walk: Path, names: tuple[str, ...]) -> tuple[Any, Any]:
    """A walk's browser fixtures, ``lab, page = walk_fixtures(WALK, names)`` in its test module: ``lab``, one
    JupyterLab a module serving copies of ``names`` (:func:`lab_with`), and ``page``, a Chromium page a test, its
    screenshot kept (:func:`screenshot_page`)."""

    @pytest.fixture(scope="module", name="lab")
    def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
        with lab_with(walk, names, tmp_path_factory) as server:
            yield server

    @pytest.fixture(name="page")
    def page(lab: LabServer, request: pytest.FixtureRequest) -> Iterator[Any]:
        with screenshot_page(request.node.name) as browser_page:
            yield browser_page

    return lab, page


def report_widget(page: Any) -> Any:
    """The first nan_magic widget on the page, waited for and scrolled into view."""
    widget = page.locator(".nan-magic-widget").first
    widget.wait_for(timeout=180_000)
    widget.scroll_into_view_if_needed()
    return widget
