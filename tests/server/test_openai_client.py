"""The official ``openai`` client against a real server: completions and chat, streaming and not, equal to the
offline ``LLM.generate`` token for token (greedy), with usage, logprobs, ``n``, stop strings, seeds and the cost
record."""

from __future__ import annotations

import pytest
from _server_util import wait_pool_empty

from litellm_pipeline import SamplingParams
from litellm_pipeline.demo import demo_prompts

PROMPTS = [ex.prompt for ex in demo_prompts(0)]  # one held-out prompt per demo skill


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_completions_equal_offline_generate(demo_server, reference):
    client = demo_server.openai()
    refs = reference.generate(PROMPTS, greedy())
    for prompt, ref in zip(PROMPTS, refs):
        resp = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0)
        (choice,) = resp.choices
        assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == len(ref.token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
        cost = choice.model_extra["cost"]
        assert cost["tier"] == "balanced" and cost["experts_per_layer"] == [2, 2, 2, 2]
        assert cost["monetary"] == pytest.approx(ref.cost.monetary)  # the same tokens at the same price
    wait_pool_empty(demo_server.engine)


def test_streamed_completion_joins_to_the_same_text_with_usage(demo_server, reference):
    client = demo_server.openai()
    prompt = PROMPTS[1]
    (ref,) = reference.generate(prompt, greedy())
    chunks = list(client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 2, "the answer came in one piece: not streamed"
    assert "".join(texts) == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ref.finish_reason and not any(finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_several_prompts_and_n(demo_server, reference):
    client = demo_server.openai()
    refs = reference.generate(PROMPTS[:2], greedy(8))
    ids = [list(r.prompt_token_ids) for r in refs]
    resp = client.completions.create(model="demo", prompt=ids, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    # choice index = prompt * n + j: each prompt's two greedy choices equal its offline text
    assert [c.text for c in resp.choices] == [refs[0].text, refs[0].text, refs[1].text, refs[1].text]
    # each prompt counted once, every choice's tokens counted
    assert resp.usage.prompt_tokens == sum(len(i) for i in ids)
    assert resp.usage.completion_tokens == 2 * sum(len(r.token_ids) for r in refs)


def test_seeded_sampling_is_reproducible_and_n_choices_get_their_own_seeds(demo_server, reference):
    client = demo_server.openai()
    kw = dict(model="demo", prompt="copy:", max_tokens=10, temperature=1.5, seed=11)
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    # choice j of a seeded request samples with seed + j, exactly as offline
    offline = [reference.generate("copy:", SamplingParams(max_tokens=10, temperature=1.5, seed=11 + j))[0].text
               for j in range(3)]
    assert [c.text for c in a.choices] == offline
    assert len(set(offline)) > 1, "the three seeds gave one text: the test cannot tell seeds apart"


def test_stop_string_and_extra_fields(demo_server, reference):
    client = demo_server.openai()
    (ref,) = reference.generate("12+345=", greedy())
    assert ref.text == "357"
    resp = client.completions.create(model="demo", prompt="12+345=", max_tokens=12, temperature=0, stop=["5"])
    assert resp.choices[0].text == "3" and resp.choices[0].finish_reason == "stop"
    # the runtime's own fields travel in extra_body: tier, ignore_eos, top_k, repetition_penalty
    resp = client.completions.create(model="demo", prompt="12+345=", max_tokens=6, temperature=0,
                                     extra_body={"tier": "fast", "ignore_eos": True, "top_k": 5,
                                                 "repetition_penalty": 1.0, "min_p": 0.0, "priority": 1})
    (fast,) = reference.generate("12+345=", greedy(6, ignore_eos=True), tier="fast")
    choice = resp.choices[0]
    assert choice.model_extra["cost"]["tier"] == "fast" and choice.model_extra["cost"]["experts_per_layer"] == [1] * 4
    assert choice.text == fast.text and resp.usage.completion_tokens == 6 and choice.finish_reason == "length"


def test_completion_logprobs(demo_server, reference):
    client = demo_server.openai()
    prompt = PROMPTS[0]
    (ref,) = reference.generate(prompt, greedy(10, logprobs=2))
    resp = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    text, lp = resp.choices[0].text, resp.choices[0].logprobs
    # the end-of-sequence token that ended it is not in the text, so not among the tokens: they join to the text
    assert ref.finish_reason == "stop" and ref.token_ids[-1] in reference.tokenizer.eos_token_ids
    n = len(ref.token_ids) - 1
    assert len(lp.tokens) == n == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == text == ref.text
    tok = reference.tokenizer
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids[:n]]
    for got, want_id, want in zip(lp.token_logprobs, ref.token_ids, ref.logprobs):
        assert got == pytest.approx(want[want_id], abs=1e-5)
    for top, sampled in zip(lp.top_logprobs, lp.token_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(sampled)  # greedy: the best is the one taken
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert resp.usage.completion_tokens == len(ref.token_ids)  # usage still counts it
    # past its end of sequence: "</s>" is a token the text skips, so it reads as nothing there
    (ref,) = reference.generate("12+345=", greedy(8, ignore_eos=True, logprobs=0))
    resp = client.completions.create(model="demo", prompt="12+345=", max_tokens=8, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    text, lp = resp.choices[0].text, resp.choices[0].logprobs
    eos_at = next(i for i, t in enumerate(ref.token_ids) if t in reference.tokenizer.eos_token_ids)
    assert eos_at < len(lp.tokens) - 1 and lp.tokens[eos_at] == "" and "</s>" not in text
    assert "".join(lp.tokens) == text
    assert lp.token_logprobs == pytest.approx([d[t] for d, t in zip(ref.logprobs, ref.token_ids)][:len(lp.tokens)],
                                              abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_logprobs_stop_at_a_stop_string(demo_server):
    """A stop string cuts the text: the tokens it cut off are not listed, streamed or not, and what is listed
    joins to the text."""
    client = demo_server.openai()
    full = client.completions.create(model="demo", prompt="12+345=", max_tokens=8, temperature=0).choices[0].text
    assert full == "357"
    resp = client.completions.create(model="demo", prompt="12+345=", max_tokens=8, temperature=0, logprobs=1,
                                     stop=["57"])
    (choice,) = resp.choices
    assert choice.text == "3" and choice.finish_reason == "stop"
    assert choice.logprobs.tokens == ["3"] and choice.logprobs.text_offset == [0]
    chunks = list(client.completions.create(model="demo", prompt="12+345=", max_tokens=8, temperature=0,
                                            logprobs=1, stop=["57"], stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == ["3"] and "".join(c.choices[0].text for c in chunks if c.choices) == "3"


def test_completion_top_logprobs_keep_the_likeliest_of_tokens_that_read_alike():
    """Completions' top_logprobs are keyed by token text: where two ids read the same (lone UTF-8 bytes all read
    U+FFFD), the key holds the higher logprob."""
    from litellm_pipeline.server.responses import ChoiceState

    texts = {5: "a", 6: "\ufffd", 7: "\ufffd", 8: "b"}

    token, lp, top = ChoiceState(0, 0, chat=False, top_k=4)._entry(5, {5: -0.1, 6: -1.0, 7: -2.0, 8: -3.0},
                                                                     texts.get)
    assert (token, lp) == ("a", -0.1) and top == {"a": -0.1, "\ufffd": -1.0, "b": -3.0}


def test_logprob_tokens_read_as_in_the_text_with_sentencepiece_word_starts():
    """A sentencepiece word token's logprob text keeps the space it reads with after other text (" world"),
    where decoding it alone drops it; a completion's first token reads as at the start of a text, as the engine's
    text (decode of the output ids) has it, so the token texts join to the text the detokenizer streams.
    Specials, lone bytes and byte-level tokens read as before."""
    from hf_models import sentencepiece_tokenizer

    from litellm_pipeline.server.responses import TokenText
    from litellm_pipeline.text.detokenizer import IncrementalDetokenizer
    from litellm_pipeline.text.tokenizer import build_byte_tokenizer

    tok = sentencepiece_tokenizer()
    text_of = TokenText(tok)
    ids = tok.encode("hello world, hi!", add_special_tokens=False)
    assert [text_of(i) for i in ids] == [" hell", "o", " wor", "ld", ",", " h", "i", "!"]
    assert tok.decode([ids[0]]) == "hell"  # alone: no space
    detok = IncrementalDetokenizer(tok, tok.encode("hi"))
    streamed = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text_of.at_start(ids[0]) + "".join(text_of(i) for i in ids[1:]) == streamed == "hello world, hi!"
    assert (text_of(1), text_of(2), text_of(3 + 0xE2)) == ("<s>", "</s>", "\ufffd")
    byte_tok = build_byte_tokenizer()
    byte_text = TokenText(byte_tok)
    assert [byte_text(i) for i in byte_tok.encode(" a b", add_special_tokens=False)] == [" ", "a", " ", "b"]


def test_models_list(demo_server):
    (model,) = demo_server.openai().models.list().data
    assert model.id == "demo" and model.owned_by == "litellm_pipeline"
    assert model.model_extra["max_model_len"] == 64
    assert [t["name"] for t in model.model_extra["tiers"]] == ["fast", "balanced", "deep", "max"]


def test_chat_equals_offline_generate_streaming_and_not(chat_server, reference):
    client = chat_server.openai()
    prompt = PROMPTS[2]
    (ref,) = reference.generate(prompt, greedy(12, logprobs=1))
    messages = [{"role": "user", "content": prompt}]
    resp = client.chat.completions.create(model="demo-chat", messages=messages, max_completion_tokens=12,
                                          temperature=0, logprobs=True, top_logprobs=1)
    (choice,) = resp.choices
    # the test template is BOS + the user's text: the same token ids as the plain prompt
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason and resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    content = choice.logprobs.content
    # the end-of-sequence token that ended it is not in the text: the entries are the text's tokens
    assert ref.token_ids[-1] in reference.tokenizer.eos_token_ids and len(content) == len(ref.token_ids) - 1
    assert "".join(e.token for e in content) == ref.text
    for entry, tid, want in zip(content, ref.token_ids, ref.logprobs):
        assert entry.logprob == pytest.approx(want[tid], abs=1e-5)
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 1
    assert choice.model_extra["cost"]["tier"] == "balanced"

    chunks = list(client.chat.completions.create(model="demo-chat", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    wait_pool_empty(chat_server.engine)


def test_chat_without_a_template_is_a_clear_400(tmp_path):
    """A checkpoint without a chat template: chat is refused naming messages and pointing at /v1/completions."""
    import json
    import shutil

    from fastapi.testclient import TestClient

    from litellm_pipeline.config.build import build_engine
    from litellm_pipeline.config.compose import compose
    from litellm_pipeline.demo import demo_checkpoint
    from litellm_pipeline.server.app import build_app

    path = tmp_path / "plain"
    shutil.copytree(demo_checkpoint(), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    app = build_app(build_engine(compose(["+recipe=serve", f"model.path={path}", "device.threads=1"])),
                    model_name="plain")
    with TestClient(app) as client:
        resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1+2="}]})
        err = resp.json()["error"]
        assert resp.status_code == 400 and err["param"] == "messages"
        assert "no chat template" in err["message"] and "/v1/completions" in err["message"]
        assert client.post("/v1/completions", json={"prompt": "1+2=", "max_tokens": 3}).status_code == 200


def test_client_sees_unknown_model_as_not_found(demo_server):
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        demo_server.openai().completions.create(model="gpt-9", prompt="1+2=", max_tokens=2)
    assert "gpt-9" in info.value.body["message"] and "'demo'" in info.value.body["message"]
    # the server stays up: the next call works
    assert demo_server.openai().completions.create(model="demo", prompt="1+2=", max_tokens=2).choices


def test_concurrent_requests_share_engine_steps(demo_server, reference):
    """Requests from separate connections run in the same engine steps and still equal their offline outputs."""
    from concurrent.futures import ThreadPoolExecutor

    from server_stages import SlowSteps

    from litellm_pipeline.telemetry import MemorySink, StepFinished

    refs = reference.generate(PROMPTS, greedy(10, ignore_eos=True))
    sink, stage = MemorySink(), demo_server.stage(SlowSteps)
    demo_server.engine.bus.subscribe(sink)
    stage.delay_s = 0.01  # arrivals over a few milliseconds land in one batch
    try:
        def ask(prompt: str) -> str:
            return demo_server.openai().completions.create(
                model="demo", prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
            ).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(ask, PROMPTS))
    finally:
        stage.delay_s = 0.0
        demo_server.engine.bus.unsubscribe(sink)
    assert texts == [r.text for r in refs]
    assert max(s.batch_size for s in sink.of(StepFinished)) >= 3, "the HTTP requests ran one after another"
