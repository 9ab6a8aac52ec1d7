"""Real servers for the server tests, one per session: ``demo_server`` serves the embedded demo model as shipped
(no chat template) with two plugin stages, one failing requests whose prompt holds ``boom`` and one that can slow
steps down; ``chat_server`` serves a copy of the demo checkpoint with a chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _server_util import CHAT_TEMPLATE, PLUGIN_STAGES, start_server, with_chat_template

from litellm_pipeline.demo import demo_checkpoint


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    # the tiny model gains nothing from more threads, and the machine's cores are shared
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def demo_server():
    live = start_server(PLUGIN_STAGES, max_n=4, max_body_bytes=4096, max_prompts=3)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> Path:
    return with_chat_template(demo_checkpoint(), tmp_path_factory.mktemp("demo-chat") / "demo-chat", CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def chat_server(chat_checkpoint):
    live = start_server([f"model.path={chat_checkpoint}"], model_name="demo-chat")
    yield live
    live.stop()


@pytest.fixture(scope="session")
def reference():
    """The offline API on the same model and config: what the server's greedy outputs must equal."""
    from litellm_pipeline import LLM

    return LLM(overrides=["+recipe=serve", "device.threads=1"])
