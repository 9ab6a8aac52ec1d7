"""The xgrammar vocabulary of a checkpoint: byte-level BPE, SentencePiece byte fallback and plain tokens decode to
the text their tokens stand for, so masks allow exactly the tokens that continue the grammar."""

from __future__ import annotations

import torch
from hf_models import sentencepiece_tokenizer

from litellm_pipeline.constraints.grammar import Grammars, bitmask_words
from litellm_pipeline.text.tokenizer import Tokenizer, build_byte_tokenizer


def allowed(grammars: Grammars, matcher) -> set[int]:
    bm = torch.zeros((1, bitmask_words(grammars.vocab_size)), dtype=torch.int32)
    matcher.fill_bitmask(bm, 0)
    return {t for t in range(grammars.vocab_size) if (int(bm[0, t // 32]) >> (t % 32)) & 1}


def test_byte_level_vocabulary():
    tok = build_byte_tokenizer()
    g = Grammars(tok, tok.vocab_size + 5, [1])  # the model may have more rows than the tokenizer names
    assert g.vocab_type == "byte_level"
    m = g.regex("é[0-9]").matcher()
    first = allowed(g, m)
    # "é" is two bytes (0xC3 0xA9): its first byte token is the only way in; padding rows never are
    assert first == {tok.encode("é", add_special_tokens=False)[0]}
    for t in tok.encode("é", add_special_tokens=False):
        assert m.accept(t)
    assert allowed(g, m) == {tok.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    assert m.accept(tok.encode("7", add_special_tokens=False)[0])
    assert allowed(g, m) == {1}  # only end-of-sequence where the regex is complete
    assert m.accept(1) and m.is_terminated()


def test_sentencepiece_byte_fallback_vocabulary():
    tok = sentencepiece_tokenizer()
    g = Grammars(tok, tok.vocab_size, sorted(tok.eos_token_ids))
    assert g.vocab_type == "byte_fallback"
    m = g.ebnf('root ::= "hello world"').matcher()
    vocab = tok._tok.get_vocab()
    # an output's first piece follows the prompt, so a "▁" in it reads as a space: "▁hell" would write " hell"
    assert allowed(g, m) == {vocab["h"], vocab["<0x68>"]}
    for t in [vocab[p] for p in ("h", "e", "ll", "o", "▁wor", "ld")]:
        assert t in allowed(g, m)
        assert m.accept(t)
    assert allowed(g, m) == set(tok.eos_token_ids)
    # "é" is not in the alphabet: only its byte-fallback tokens <0xC3><0xA9> write it
    m = g.ebnf('root ::= "é"').matcher()
    assert allowed(g, m) == {3 + 0xC3}


def test_plain_vocabulary_of_the_demo_model():
    from litellm_pipeline.demo import demo_checkpoint

    tok = Tokenizer.from_dir(demo_checkpoint())
    g = Grammars(tok, tok.vocab_size, sorted(tok.eos_token_ids))
    assert g.vocab_type == "raw"
    assert allowed(g, g.regex("[0-9]").matcher()) == {tok.encode(str(d), add_special_tokens=False)[-1]
                                                       for d in range(10)}
    assert allowed(g, g.json_schema({"type": "object"}).matcher()) == set()  # it has no "{" to write
