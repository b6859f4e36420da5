"""OSCAR_ZOO_HUB_TIMEOUT is bounded (a number of seconds in (0, 3600]): anything else is exit 2 with one line before
any request, never an OverflowError traceback. A silent hub's message says how long the call waited in all when the hub
client's own retries made that longer than the per-request timeout. Real `oscar-zoo` processes, as a user runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .helpers import HF_TOKEN, MS_TOKEN
from .local_server import SilentServer

LIMIT = 600  # seconds before the subprocess is killed: a guard against a hang, not a measurement
REFUSAL_LIMIT = 120  # a refused timeout answers before any request; one accepted would wait on the silent hub


@pytest.fixture
def silent_hub():
    server = SilentServer().start()
    yield server
    server.stop()


def _run(args: list[str], silent_hub, tmp_path, timeout: str, limit: int = LIMIT,
         retries: str = "1") -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MODELSCOPE_", "OSCAR_ZOO_"))}
    env.update(OSCAR_ZOO_HUB_TIMEOUT=timeout, HF_ENDPOINT=silent_hub.url, HF_HOME=str(tmp_path / "hf-home"),
               HF_HUB_OFFLINE="0", HF_TOKEN=HF_TOKEN, MODELSCOPE_ENDPOINT=silent_hub.url,
               MODELSCOPE_CACHE=str(tmp_path / "ms-cache"), MODELSCOPE_HOME=str(tmp_path / "ms-home"),
               MODELSCOPE_API_TOKEN=MS_TOKEN, MODELSCOPE_API_MAX_RETRIES=retries)
    proc = subprocess.run([sys.executable, "-m", "oscar_zoo", *args], env=env, capture_output=True, text=True,
                          timeout=limit, cwd=tmp_path)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("hub, value", [("hf", "1e12"), ("modelscope", "1e12"), ("hf", "3601"), ("hf", "inf"),
                                        ("hf", "-1"), ("hf", "0")])
def test_an_unbounded_timeout_is_exit_2_before_any_request(silent_hub, tmp_path, hub, value):
    code, err = _run(["pull", "zoo/rotations/tiny-llama", "--hub", hub, "--dest", str(tmp_path / "pulled")],
                     silent_hub, tmp_path, value, REFUSAL_LIMIT)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 2, err
    assert lines[0].startswith(f"error: OSCAR_ZOO_HUB_TIMEOUT='{value}' is not a number of seconds in (0, 3600]")
    assert not silent_hub.connections and not (tmp_path / "pulled").exists()


def test_the_largest_timeout_is_accepted(monkeypatch):
    from oscar_zoo.hub.base import hub_timeout

    monkeypatch.setenv("OSCAR_ZOO_HUB_TIMEOUT", "3600")
    assert hub_timeout() == 3600.0


@pytest.mark.parametrize("hub", ["hf", "modelscope"])
def test_a_silent_hub_message_states_the_total_wait(silent_hub, tmp_path, hub):
    """Both clients retry a request that timed out (huggingface_hub once for repo_info; ModelScope as
    MODELSCOPE_API_MAX_RETRIES says, here 2 attempts, with backoff): the line says the whole wait, not only the 2 s."""
    code, err = _run(["pull", "zoo/rotations/tiny-llama", "--hub", hub, "--dest", str(tmp_path / "pulled")],
                     silent_hub, tmp_path, "2", retries="2")
    assert code == 5, err
    first = err.strip().splitlines()[0]
    assert "did not answer within 2 s (" in first and "Traceback" not in err, err
    found = re.search(r"gave up after (\d+) s in all, the hub client's retries included", first)
    assert found and int(found.group(1)) >= 3, err
    assert len(silent_hub.connections) >= 2  # the retry happened: what the total accounts for
