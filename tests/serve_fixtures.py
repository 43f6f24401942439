"""The module server of tests/test_serve.py: one `python -m jaxrag.serve` process (4 slots) on
127.0.0.1 over `benchmarks.serve_exports.tiny_export`, the reference answers `SRRAG.ask` gives each
question alone, and readers of its `/metrics`."""

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks.serve_exports import tiny_export, tiny_questions

REPO = Path(__file__).resolve().parent.parent
SLOTS, QUEUE, QUESTION_TOKENS = 4, 80, 64
QUESTIONS = tiny_questions(64, seed=11)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(export: Path, port: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxrag.serve", str(export), "--port", str(port), *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError("server not healthy in time")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(export):
    """(base URL, process). The process is started first; `reference` runs while it compiles."""
    port = free_port()
    proc = start_server(export, port, "--slots", str(SLOTS), "--max-queue", str(QUEUE),
                        "--max-question-tokens", str(QUESTION_TOKENS))
    yield f"http://127.0.0.1:{port}", proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def reference(export, server):
    """Each question routed alone by `SRRAG.ask`, in this process."""
    from jaxrag.serve import SRRAG

    system = SRRAG.load(export)
    return system, {q: system.ask([q])[0] for q in QUESTIONS}


@pytest.fixture(scope="module")
def url(server, reference):
    base, proc = server
    wait_healthy(proc, base)
    return base


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def shared_steps(url: str) -> np.ndarray:
    """(calls of decode steps, calls that advanced more than one request, requests advanced) so far."""
    calls = metric(url, "srrag_step_rows_count")
    alone = metric(url, 'srrag_step_rows_bucket{le="1.0"}')
    return np.array([calls, calls - alone, metric(url, "srrag_step_rows_sum")])


def device_calls(url: str) -> np.ndarray:
    """The engine's device calls so far: question prefills, pool entries, calls of decode steps."""
    return np.array([metric(url, f'srrag_device_calls_total{{call="{call}"}}') for call in ("admit", "enter", "steps")])


def assert_same_route(trace: dict, answer: str, alone, sources) -> None:
    assert (trace["source"], trace["knowledge"]["text"], answer) == (alone.source, alone.knowledge, alone.answer)
    assert trace["knowledge"]["truncated"] == alone.knowledge_truncated
    np.testing.assert_allclose([trace["p_M"][s] for s in sources], alone.p_model, rtol=1e-5)
    assert [trace["p_D"][s] for s in sources] == alone.p_datastore
