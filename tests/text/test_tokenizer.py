"""Tokenizer tests: byte tokenizer, sentencepiece-style streaming, HF layout checked against transformers."""

import json
import re

import pytest
from hf_models import sentencepiece_tokenizer

from litellm_pipeline.text.detokenizer import IncrementalDetokenizer
from litellm_pipeline.text.tokenizer import (
    Tokenizer,
    TokenizerError,
    build_byte_tokenizer,
)

TEXTS = ["hello world", "héllo wörld", "你好，世界", "emoji 👋🏽 and 🙂!", "mixed 日本語 text 🚀 end", " lead", "a  b\n c"]
CHAT = [{"role": "user", "content": "Hi there 👋"}, {"role": "assistant", "content": "Hello! 你好"}]


def stream(tok: Tokenizer, ids, prompt=(1,), skip=True):
    detok = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens=skip)
    return [detok.add(i) for i in ids], detok


# ---- byte tokenizer ---------------------------------------------------------------------------------------------

def test_byte_tokenizer_layout_is_fixed():
    tok = build_byte_tokenizer()
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<s>", "</s>", "<pad>"]
    assert tok.vocab_size == 3 + 256
    assert tok.bos_token_id == 0 and tok.eos_token_ids == frozenset({1})
    assert tok.encode("A") == [0, 3 + ord("A")]
    assert tok.encode("é", add_special_tokens=False) == [3 + b for b in "é".encode()]
    assert build_byte_tokenizer().encode(TEXTS[4]) == tok.encode(TEXTS[4])
    assert [tok.is_special(i) for i in (0, 1, 2, 3, 258)] == [True, True, True, False, False]
    assert tok.decode([3 + ord("A"), 10**6]) == "A"  # ids past the vocab (padded model heads) are skipped


def test_text_that_is_not_unicode_is_named_not_passed_on():
    """A lone UTF-16 surrogate (JSON's "\\ud800" escape can carry one) is no text: TokenizerError names it."""
    tok = build_byte_tokenizer()
    for text, where in (("\ud800abc", "U+D800 at character 0"), ("ab\udfff", "U+DFFF at character 2")):
        with pytest.raises(TokenizerError, match=re.escape(f"text is not valid Unicode: a lone surrogate {where}")):
            tok.encode(text)
    assert tok.encode(json.loads('"\\ud83d\\ude00"')) == tok.encode("😀")  # JSON's escaped pair is one character
    with pytest.raises(TypeError):
        tok.encode(5)  # not text at all: the tokenizers library's own error


def test_added_non_special_token_is_kept_by_decode():
    tok = build_byte_tokenizer()
    tok._tok.add_tokens(["<tool>"])
    tok = Tokenizer.from_tokenizer(tok._tok, eos_token="</s>", bos_token="<s>")
    ids = tok.encode("a<tool>b")
    assert ids == [0, 3 + ord("a"), 259, 3 + ord("b")] and tok.vocab_size == 260
    assert not tok.is_special(259) and tok.is_special(1)
    assert tok.decode(ids + [1]) == "a<tool>b"
    with pytest.raises(TokenizerError, match="260"):
        tok.convert_ids_to_tokens([260])


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text):
    tok = build_byte_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 1 + len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_streaming_never_splits_characters(text):
    tok = build_byte_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    deltas, detok = stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text


def test_streaming_catches_naive_per_token_decode():
    # Guards the streaming tests above: decoding token by token really does produce broken characters here.
    tok = build_byte_tokenizer()
    ids = tok.encode("👋", add_special_tokens=False)
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)


# ---- sentencepiece style ----------------------------------------------------------------------------------------

def test_sentencepiece_fixture_uses_byte_fallback_and_word_pieces():
    tok = sentencepiece_tokenizer()
    assert tok.convert_ids_to_tokens(tok.encode("hello 你", add_special_tokens=False)) == [
        "▁hell", "o", "▁", "<0xE4>", "<0xBD>", "<0xA0>"]


@pytest.mark.parametrize("text", TEXTS + ["hello world, hello!", "wörld 🙂 hello"])
def test_sentencepiece_streaming_matches_full_decode(text):
    tok = sentencepiece_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    deltas, detok = stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids)


def test_sentencepiece_streaming_keeps_word_spaces():
    tok = sentencepiece_tokenizer()
    ids = tok.encode("hello world hello", add_special_tokens=False)
    deltas, detok = stream(tok, ids)
    assert detok.text == "hello world hello"
    # Per-token decode strips every '▁' space; the windowed decode must keep them between words.
    assert "".join(tok.decode([i]) for i in ids) != detok.text
    assert [d for d in deltas if d.startswith(" ")] == [" wor", " hell"]


def test_sentencepiece_streaming_byte_fallback_waits_for_whole_character():
    tok = sentencepiece_tokenizer()
    ids = tok.encode("a 你", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["▁", "a", "▁", "<0xE4>", "<0xBD>", "<0xA0>"]
    deltas, _ = stream(tok, ids)
    assert deltas == ["", "a", " ", "", "", "你"]


def test_streaming_says_where_a_token_after_held_bytes_starts():
    """A byte that is no whole character is held back and comes out with the next token's text; `last_lead`
    says how much of that text is the held bytes', so the next token's offset (what the emit stage records)
    points at its own text, not at the held bytes; a last token's too, after the flush that ends the request.
    Held bytes keep the start of their run."""
    tok = sentencepiece_tokenizer()
    cases = [(["!", "<0xBD>", "ld", "w", "<0xE4>", "h"], "!\ufffdldw\ufffdh", [0, 1, 2, 4, 5, 6]),
             (["<0xF8>", "<0x3B>", "<0xE7>", "x"], "\ufffd\ufffd\ufffdx", [0, 0, 0, 3]),
             (["▁", "a", "▁", "<0xE4>", "<0xBD>", "<0xA0>", "b"], "a 你b", [0, 0, 1, 2, 2, 2, 3])]
    for pieces, text, offsets in cases:
        detok = IncrementalDetokenizer(tok, [1])
        got = []
        ids = [tok._tok.token_to_id(p) for p in pieces]
        for k, i in enumerate(ids):
            before = len(detok.text)
            detok.add(i)
            if k == len(ids) - 1:
                detok.flush()  # the request ends with this token
            got.append(min(before + detok.last_lead, len(detok.text)))
        assert (detok.text, got) == (text, offsets), pieces


def test_streaming_skips_special_tokens_like_decode():
    tok = sentencepiece_tokenizer()
    ids = tok.encode("hello", add_special_tokens=False) + [2] + tok.encode("world 🙂", add_special_tokens=False)
    for skip in (True, False):
        deltas, detok = stream(tok, ids, skip=skip)
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in d for d in deltas)


def test_flush_releases_incomplete_trailing_character():
    tok = sentencepiece_tokenizer()
    ids = tok.encode("ab 🙂", add_special_tokens=False)[:-2]  # cut the emoji's bytes short
    deltas, detok = stream(tok, ids)
    assert detok.text == "ab "
    assert detok.flush() == "\ufffd\ufffd"
    assert detok.text == tok.decode(ids) == "ab \ufffd\ufffd"
    assert detok.flush() == ""


# ---- files: save / from_dir / errors ----------------------------------------------------------------------------

def test_save_then_from_dir_round_trips(tmp_path):
    tok = sentencepiece_tokenizer(chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok.save(tmp_path)
    back = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)
    assert back.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT) == "<s>Hi there 👋Hello! 你好"
    assert (back.bos_token_id, back.eos_token_ids, back.vocab_size) == (1, frozenset({2}), tok.vocab_size)


def test_missing_tokenizer_json_names_the_path(tmp_path):
    with pytest.raises(TokenizerError, match="not found") as err:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(err.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_corrupt_json_names_the_file(tmp_path, name):
    build_byte_tokenizer().save(tmp_path)
    (tmp_path / name).write_text('{"eos_token": ')
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / name) in str(err.value)


@pytest.mark.parametrize("gen_eos, expected", [([1, 5, 7], {1, 5, 7}), (9, {1, 9}), (None, {1})])
def test_eos_ids_merge_tokenizer_config_and_generation_config(tmp_path, gen_eos, expected):
    build_byte_tokenizer().save(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos, "bos_token_id": 0}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == frozenset(expected)


def test_from_dir_reads_added_token_dicts_and_generation_bos(tmp_path):
    build_byte_tokenizer().save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"__type": "AddedToken", "content": "<pad>"}, "bos_token": None}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == frozenset({2, 1}) and tok.bos_token_id == 0
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(CHAT)


# ---- chat templates ---------------------------------------------------------------------------------------------

def test_chat_template_environment_matches_transformers_helpers():
    template = ("{% if messages|length > 1 %}{{ raise_exception('only one message, got ' ~ messages|length) }}"
                "{% endif %}{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}|{{ foo }}"
                "{% for m in messages %}{% if loop.first %}{% break %}{% endif %}{% endfor %}")
    tok = Tokenizer.from_tokenizer(build_byte_tokenizer()._tok, eos_token="</s>", bos_token="<s>",
                                   chat_template=template)
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}], foo="bar")
    assert out == '{"role": "user", "content": "<é>"}|4|bar'
    with pytest.raises(TokenizerError, match="only one message, got 2"):
        tok.apply_chat_template(CHAT)


def test_named_chat_templates_pick_default_and_tool_use(tmp_path):
    build_byte_tokenizer().save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template(CHAT) == "D"
    assert tok.apply_chat_template(CHAT, tools=[{"name": "f"}]) == "T"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages|length }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CHAT) == "J2"


# ---- transformers is the oracle ---------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def hf_load(path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


# Block tags on their own lines: only renders the same if trim_blocks/lstrip_blocks match transformers.
MULTILINE_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'user' %}
U: {{ message['content'] }}
    {% else %}
A: {{ message['content'] }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
A:
{% endif %}"""


@pytest.mark.parametrize("make", [build_byte_tokenizer, lambda: sentencepiece_tokenizer(LLAMA2_TEMPLATE),
                                  lambda: sentencepiece_tokenizer(MULTILINE_TEMPLATE)])
def test_saved_dir_loads_in_transformers_with_same_ids_and_chat(tmp_path, make):
    tok = make()
    tok.save(tmp_path)
    hf = hf_load(tmp_path)
    for text in TEXTS + ["a </s> b", "hello , world . it 's"]:
        assert hf(text).input_ids == tok.encode(text), text
        assert hf(text, add_special_tokens=False).input_ids == tok.encode(text, add_special_tokens=False)
        ids = tok.encode(text)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)
        assert hf.decode(ids) == tok.decode(ids, skip_special_tokens=False)
    for gen in (True, False):
        assert hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen) == \
            tok.apply_chat_template(CHAT, add_generation_prompt=gen)
    assert hf.eos_token_id in tok.eos_token_ids and hf.bos_token_id == tok.bos_token_id
    assert len(hf) == tok.vocab_size


@pytest.mark.parametrize("flags", [{"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}])
def test_add_bos_eos_flags_follow_transformers(tmp_path, flags):
    # transformers ignores these flags when tokenizer.json exists; its post-processor alone decides.
    sentencepiece_tokenizer().save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
    tok, hf = Tokenizer.from_dir(tmp_path), hf_load(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == hf(text).input_ids == [1, *tok.encode(text, add_special_tokens=False)]
