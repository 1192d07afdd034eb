"""A notebook run in a real kernel where some cells talk to the person: the debugger's prompts answered over the
kernel's stdin channel, as a frontend's input box answers them, and the kernel interrupted (the stop button).

nbclient runs every other cell (its outputs, the stored widget state); a cell named in ``answers`` is sent with
``allow_stdin=True`` and each ``input_request`` (``ipdb> ``) gets the next answer, so ``%debug`` runs as IPython's
own debugger in the kernel, not with ``input`` patched in the user's namespace. Its transcript (the prompts, the
answers, what the debugger printed) becomes the cell's one stream output. A cell named in ``interrupted`` gets
SIGINT that many seconds after it starts (nbclient's ``interrupt_on_timeout``).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from queue import Empty
from typing import Any

from jupyter_support import isolated_env


async def _converse(client: Any, source: str, answers: list[str], timeout: float) -> str:
    """Run ``source`` with stdin allowed, answering each prompt in turn; the transcript, once the kernel is idle."""
    kc = client.kc
    msg_id = kc.execute(source, allow_stdin=True, store_history=True)
    transcript: list[str] = []
    pending = list(answers)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            request = await kc.get_stdin_msg(timeout=0.05)
        except (Empty, asyncio.TimeoutError):
            request = None
        if request is not None and request["msg_type"] == "input_request":
            # stdin and iopub are two sockets: what the debugger printed before its prompt may still be on its way.
            while await _take_iopub(kc, msg_id, transcript, timeout=0.3) is not None:
                pass
            # A prompt left unanswered by the test would hang the kernel: quit the debugger instead.
            answer = pending.pop(0) if pending else "q"
            transcript.append(request["content"]["prompt"] + answer + "\n")
            kc.input(answer)
        if await _take_iopub(kc, msg_id, transcript, timeout=0.05) == "idle":
            assert not pending, f"the debugger stopped asking before {pending}"
            return "".join(transcript)
    raise TimeoutError(f"the cell did not finish in {timeout} s:\n{''.join(transcript)}")


async def _take_iopub(kc: Any, msg_id: str, transcript: list[str], timeout: float) -> str | None:
    """Take one iopub message (None where none came in ``timeout``), adding the cell's text to ``transcript``;
    ``"idle"`` once the cell is done."""
    try:
        message = await kc.get_iopub_msg(timeout=timeout)
    except (Empty, asyncio.TimeoutError):
        return None
    content = message["content"]
    if message["parent_header"].get("msg_id") != msg_id:
        return "other"
    if message["msg_type"] == "stream":
        transcript.append(content["text"])
    elif message["msg_type"] == "error":
        transcript.append("\n".join(content["traceback"]))
    elif message["msg_type"] == "status" and content["execution_state"] == "idle":
        return "idle"
    return message["msg_type"]


async def _run(nb: Any, path: Path, answers: dict[str, list[str]], interrupted: dict[str, int],
               scratch: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
        timeout_func=lambda cell: interrupted.get(cell.metadata.get("name"), 300), interrupt_on_timeout=True,
    )
    async with client.async_setup_kernel(env=isolated_env(scratch)):
        for index, cell in enumerate(nb.cells):
            name = cell.metadata.get("name")
            if name in answers:
                text = await _converse(client, cell.source, answers[name], timeout=120)
                cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
            else:
                await client.async_execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
        client.set_widgets_metadata()


def execute_in_dialogue(path: Path, answers: dict[str, list[str]], interrupted: dict[str, int] | None = None) -> Any:
    """Execute the notebook at ``path`` in a fresh kernel, answering ``answers`` and interrupting ``interrupted``
    (cell name -> seconds); return it executed (and saved back to ``path``, so it can be exported)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="nan-magic-dialogue-") as scratch:
        asyncio.run(_run(nb, path, answers, interrupted or {}, Path(scratch)))
    nbformat.write(nb, path)
    return nb
