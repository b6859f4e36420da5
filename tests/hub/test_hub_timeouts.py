"""A hub that accepts connections and never answers: pull and push give up after $OSCAR_ZOO_HUB_TIMEOUT with one line
naming the call that got no answer (exit 5). Run as real `oscar-zoo` processes -- the way a user meets a hang, and so
that a regression fails on the subprocess limit instead of hanging the suite. What proves the timeout fired is the
process's own message (the call that got no answer within 1 s) and its exit code, not the wall clock: a slow or loaded
machine may take minutes to start the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .helpers import HF_TOKEN, MS_TOKEN, run_cli
from .local_server import SilentServer

LIMIT = 900  # seconds before the subprocess is killed: a guard against a hang, not a measurement


@pytest.fixture
def silent_hub():
    server = SilentServer().start()
    yield server
    server.stop()


def _run(args: list[str], silent_hub, tmp_path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MODELSCOPE_", "OSCAR_ZOO_"))}
    env.update(OSCAR_ZOO_HUB_TIMEOUT="1", HF_ENDPOINT=silent_hub.url, HF_HOME=str(tmp_path / "hf-home"),
               HF_HUB_OFFLINE="0", HF_TOKEN=HF_TOKEN, MODELSCOPE_ENDPOINT=silent_hub.url,
               MODELSCOPE_CACHE=str(tmp_path / "ms-cache"), MODELSCOPE_HOME=str(tmp_path / "ms-home"),
               MODELSCOPE_API_TOKEN=MS_TOKEN,
               MODELSCOPE_API_MAX_RETRIES="1")  # the client's own retry policy, not ours: one attempt keeps this fast
    proc = subprocess.run([sys.executable, "-m", "oscar_zoo", *args], env=env, capture_output=True, text=True,
                          timeout=LIMIT, cwd=tmp_path)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("hub, command, call", [
    ("hf", "pull", "repo_info"),
    ("hf", "push", "create_repo"),
    ("modelscope", "pull", "repo_exists"),
    ("modelscope", "push", "repo_exists"),
])
def test_a_hub_that_never_answers_is_exit_5_naming_the_call(silent_hub, artifacts, tmp_path, hub, command, call):
    args = (["pull", "zoo/rotations/tiny-llama", "--dest", str(tmp_path / "pulled")] if command == "pull"
            else ["push", str(artifacts), "zoo/rotations"])
    code, err = _run([*args, "--hub", hub], silent_hub, tmp_path)
    assert code == 5, err
    first = err.strip().splitlines()[0]
    assert f"did not answer within 1 s ({call}" in first and silent_hub.url in first, err
    assert "OSCAR_ZOO_HUB_TIMEOUT" in err and "Traceback" not in err
    assert not (tmp_path / "pulled").exists()


def test_a_malformed_timeout_is_bad_input(hub_env, monkeypatch, tmp_path):
    monkeypatch.setenv("OSCAR_ZOO_HUB_TIMEOUT", "soon")
    code, _, err = run_cli("pull", "zoo/rotations/tiny-llama", "--dest", str(tmp_path / "x"))
    assert code == 2 and "OSCAR_ZOO_HUB_TIMEOUT='soon'" in err
