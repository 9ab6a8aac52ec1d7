"""Logprob tokens are the output's text, token by token: where the detokenizer holds a token's text back (a
character split over byte tokens, ByteFallback's ``<0xC3><0xA9>`` or byte-level BPE's), the tokens still join to
the text, streamed or not, and chat's ``bytes`` join to its UTF-8."""

from __future__ import annotations

import json
import shutil

import pytest

from litellm_pipeline import LLM
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.server.responses import ChoiceState, TokenText


def _drive(llm, prompt, sp, chat):
    """One request through the engine, each of its outputs through the server's ChoiceState as the app does."""
    eng = llm.engine
    req = eng.add_request(prompt, sp)
    state, text_of = ChoiceState(0, 0, chat=chat, top_k=2), TokenText(llm.tokenizer)
    chunks, final = [], None
    while final is None:
        for out in eng.step():
            if out.request_id == req.request_id:
                chunks.append(state.add(out, text_of))
                final = out if out.finished else None
    return state, final, chunks, text_of


def _check(llm, prompts, seeds, max_tokens=24):
    split = 0  # tokens whose text reads otherwise alone than in the output (part of a character)
    for prompt in prompts:
        for seed in seeds:
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, logprobs=2)
            state, out, chunks, text_of = _drive(llm, prompt, sp, chat=False)
            body = state.logprobs_body()
            tokens = body["tokens"]
            assert "".join(tokens) == out.text == state.text
            assert body["text_offset"] == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
            n = len(tokens)
            assert n in (len(out.token_ids), len(out.token_ids) - 1)  # less the end-of-sequence token, if it ended so
            assert body["token_logprobs"] == pytest.approx([lp[t] for lp, t in zip(out.logprobs, out.token_ids)][:n])
            # streamed: each chunk's tokens are its text's, never ahead of it
            given, shown = "", ""
            for text, lp in chunks:
                shown += text
                given += "".join(lp["tokens"]) if lp else ""
                assert shown.startswith(given)
            assert given == shown == out.text
            split += sum(text_of(t) != s for t, s in zip(out.token_ids[1:n], tokens[1:]))
            # chat: the same tokens, and their bytes join to the text's UTF-8
            state, out2, _, _ = _drive(llm, prompt, sp, chat=True)
            content = state.logprobs_body()["content"]
            assert out2.token_ids == out.token_ids
            assert [e["token"] for e in content] == tokens
            assert b"".join(bytes(e["bytes"]) for e in content) == out.text.encode()
    return split


@pytest.fixture(scope="module")
def byte_level(hf_checkpoint):
    return LLM(model=str(hf_checkpoint("llama")), dtype="float32")


def test_byte_level_tokens_join_to_the_text(byte_level):
    from hf_models import random_prompts

    split = _check(byte_level, random_prompts([5, 9], seed=3), seeds=range(6))
    assert split > 0  # the random bytes made characters of several tokens: the case under test happened


@pytest.fixture(scope="module")
def byte_fallback(hf_checkpoint, tmp_path_factory):
    """The tiny llama with a Llama-style tokenizer: Metaspace word pieces, ByteFallback for the rest."""
    from hf_models import VOCAB_SIZE, sentencepiece_tokenizer

    path = tmp_path_factory.mktemp("sp") / "llama-sp"
    shutil.copytree(hf_checkpoint("llama"), path)
    tok = sentencepiece_tokenizer()._tok
    tok.add_tokens([f"<|extra_{i}|>" for i in range(VOCAB_SIZE - tok.get_vocab_size())])  # every id the model makes
    tok.save(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(bos_token="<s>", eos_token="</s>", pad_token=None, chat_template=None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "special_tokens_map.json").unlink(missing_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            c = json.loads((path / name).read_text())
            c.update(bos_token_id=1, eos_token_id=2, pad_token_id=None)
            (path / name).write_text(json.dumps(c))
    return LLM(model=str(path), dtype="float32")


def test_byte_fallback_tokens_join_to_the_text(byte_fallback):
    tok = byte_fallback.tokenizer
    prompts = ["hé", "a€b", "hello world"]
    assert any(len(tok.encode(p, add_special_tokens=False)) > len(p) for p in prompts)  # byte tokens in them
    split = _check(byte_fallback, prompts, seeds=range(6))
    assert split > 0
