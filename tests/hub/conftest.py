"""Fixtures for hub tests: an artifact folder, an isolated hub cache and config (online), and a fake Hugging Face Hub
and a fake ModelScope on 127.0.0.1 with tokens in the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import HF_TOKEN, MS_TOKEN, make_artifacts


@pytest.fixture
def artifacts(tmp_path) -> Path:
    make_artifacts(tmp_path / "art")
    return tmp_path / "art"


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """An isolated HF/ModelScope cache and config; online mode (the project conftest sets HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-cache"))
    monkeypatch.setenv("MODELSCOPE_HOME", str(tmp_path / "ms-home"))
    monkeypatch.delenv("MODELSCOPE_API_TOKEN", raising=False)
    monkeypatch.delenv("OSCAR_ZOO_CATALOG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return home


@pytest.fixture
def hf_hub(hub_env, monkeypatch):
    """The fake Hub; the client's Xet transfer is off (HF_HUB_DISABLE_XET=1, read at import, so the constant too), so
    binary files take the LFS protocol the fake speaks, as they do on the real Hub without hf_xet."""
    from huggingface_hub import constants

    from .fake_hf import FakeHub

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    hub = FakeHub(tokens={HF_TOKEN}).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    yield hub
    hub.stop()


@pytest.fixture
def ms_hub(hub_env, monkeypatch):
    import modelscope_hub.config

    from .fake_modelscope import FakeModelScope

    monkeypatch.setattr(modelscope_hub.config, "_default_config", None)  # process-wide; caches the cache dir
    hub = FakeModelScope(tokens={MS_TOKEN}).start()
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", hub.url)
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", MS_TOKEN)
    yield hub
    hub.stop()


