"""The endpoint under test: one Ray Serve application on the session's local Ray, HTTP on
127.0.0.1 at a free port, serving a small target with a trained EAGLE-3 head, an API key, tight
limits (so 429 and the length checks are reachable) and Data Capture to a temporary folder."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from serving_models import build_served_target, train_served_head

API_KEY = "test-key-5f3a"
MAX_SLOTS = 4
MAX_WAITING = 4
MAX_LEN = 2048
MAX_PROMPT_TOKENS = 160
MAX_TOKENS_LIMIT = 1900


@pytest.fixture(scope="session")
def served_target_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_served_target(tmp_path_factory.mktemp("served-target") / "tiny-served", tokenizer_dir)


@pytest.fixture(scope="session")
def served_head_dir(tmp_path_factory, served_target_dir) -> Path:
    return train_served_head(served_target_dir, tmp_path_factory.mktemp("served-head") / "eagle3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint(ray_local, served_target_dir, served_head_dir, tmp_path_factory):
    """(base URL, ServeConfig) of the deployed application; Serve is shut down after the module."""
    from ray import serve

    from aerie.serving.config import ServeConfig
    from serve_apps.openai_app import deploy

    config = ServeConfig(
        target=str(served_target_dir), method="eagle3", head=str(served_head_dir), k=3,
        name="aerie-test", port=_free_port(), api_key=API_KEY, max_slots=MAX_SLOTS, max_waiting=MAX_WAITING,
        max_len=MAX_LEN, max_prompt_tokens=MAX_PROMPT_TOKENS, max_tokens_limit=MAX_TOKENS_LIMIT, num_cpus=0,
        capture={"destination": str(tmp_path_factory.mktemp("capture")), "flush_seconds": 0.5},
    )
    url = deploy(config, timeout_s=180)
    yield url, config
    serve.delete(config.name)
    serve.shutdown()
