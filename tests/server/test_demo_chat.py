"""The default model chats: its checkpoint's chat template makes the last user message the prompt the model knows,
so the official ``openai`` client and the LiteLLM SDK get the skills' answers, plain and streamed."""

from __future__ import annotations

import os

import pytest
from _server_util import wait_pool_empty

# LiteLLM fetches a model price list from GitHub on import unless told to use its local copy (no network here)
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ASK = [{"role": "user", "content": "5+414="}]
# a system message and earlier turns: the demo model sees only the last user message
CONVERSATION = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "rev:abc="},
                {"role": "assistant", "content": "cba"}, {"role": "user", "content": "5+414="}]


@pytest.mark.parametrize("messages", [ASK, CONVERSATION], ids=["one-turn", "system-and-earlier-turns"])
def test_openai_client_chats_with_the_demo_model(demo_server, messages):
    client = demo_server.openai()
    resp = client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=8)
    assert resp.choices[0].message.content == "419" and resp.choices[0].finish_reason == "stop"
    # the prompt is BOS + the last user message, whatever came before it
    assert resp.usage.prompt_tokens == 1 + len("5+414=")
    chunks = list(client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "419"
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    wait_pool_empty(demo_server.engine)


@pytest.mark.filterwarnings("ignore:Items? .*ReadOnly:UserWarning")  # LiteLLM's own TypedDicts, on import
def test_litellm_sdk_chats_with_the_demo_model(demo_server):
    litellm = pytest.importorskip("litellm")
    kw = dict(model="openai/demo", api_base=demo_server.url + "/v1", api_key="unused", temperature=0, max_tokens=8)
    resp = litellm.completion(messages=ASK, **kw)
    assert resp.choices[0].message.content == "419"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(messages=CONVERSATION,
                                                                                           stream=True, **kw))
    assert streamed == "419"
    wait_pool_empty(demo_server.engine)


def test_the_template_is_the_one_transformers_renders(demo_server):
    transformers = pytest.importorskip("transformers")
    from litellm_pipeline.demo import demo_checkpoint

    hf = transformers.AutoTokenizer.from_pretrained(str(demo_checkpoint()))
    ours = demo_server.engine.tokenizer
    for messages in (ASK, CONVERSATION):
        text = ours.apply_chat_template(messages)
        assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "<s>5+414="
        assert ours.encode(text, add_special_tokens=False) == ours.encode("5+414=")
