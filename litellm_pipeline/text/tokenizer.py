"""Tokenizer for Hugging Face checkpoints: encode/decode, special tokens, chat templates (rendered by
:mod:`~litellm_pipeline.text.chat_template`); streaming text is :mod:`~litellm_pipeline.text.detokenizer`'s.

Wraps a `tokenizers.Tokenizer` (tokenizer.json) plus the special tokens and chat template from the checkpoint's
tokenizer_config.json / chat_template.jinja / generation_config.json, mirroring what `transformers` does with the same
files, so prompts and decoded text match the oracle without importing it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from litellm_pipeline.text.chat_template import TemplateError, compile_template

__all__ = ["TokenizerError", "Tokenizer", "build_byte_tokenizer"]

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerError(ValueError):
    """A tokenizer file is missing or broken, or a chat template cannot be rendered."""


def not_unicode(text: str) -> str | None:
    """Why ``text`` is not valid Unicode text (a lone UTF-16 surrogate, which JSON's ``\\ud800`` escapes can
    carry into a Python str), or None if it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"text is not valid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start} "
                "(UTF-16 surrogates come only in pairs)")
    return None


def _read_json(path: Path, required: bool) -> dict | None:
    if not path.is_file():
        if required:
            raise TokenizerError(f"tokenizer file not found: {path}")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"corrupt JSON in {path}: {exc}") from exc


def _token_content(value: Any) -> str | None:
    # tokenizer_config stores special tokens either as plain strings or as serialized AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A checkpoint's tokenizer: ids <-> text, special token ids and chat template rendering."""

    def __init__(self, tok: _HFTokenizer, special_tokens: dict[str, str | None],
                 chat_templates: dict[str, str], extra_eos_ids: Sequence[int] = (), bos_token_id: int | None = None):
        self._tok = tok
        self.special_tokens = dict(special_tokens)
        self.chat_templates = dict(chat_templates)
        self._compiled: dict[str, jinja2.Template] = {}
        added = tok.get_added_tokens_decoder()
        # "Special" means exactly what decode(skip_special_tokens=True) drops, so the engine and decode agree.
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        # Added tokens may sit past the base vocab with gaps; the model's vocab must cover the largest id.
        self.vocab_size: int = max(tok.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        bos = special_tokens.get("bos_token")
        self.bos_token_id: int | None = tok.token_to_id(bos) if bos else None
        if self.bos_token_id is None:
            self.bos_token_id = bos_token_id
        eos = special_tokens.get("eos_token")
        eos_id = tok.token_to_id(eos) if eos else None
        self.eos_token_ids: frozenset[int] = frozenset(
            [*([eos_id] if eos_id is not None else []), *extra_eos_ids])

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer directory.

        tokenizer.json is required and its post-processor decides BOS/EOS insertion; tokenizer_config.json (special
        tokens, chat_template; add_bos_token/add_eos_token are ignored as transformers does), chat_template.jinja / additional_chat_templates/*.jinja (override the config's template, as in transformers)
        and generation_config.json (eos_token_id int or list, bos_token_id) are optional. A missing or corrupt file
        raises TokenizerError naming it.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        _read_json(tok_file, required=True)  # gives a clear error for missing/corrupt JSON before tokenizers does
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception for schema errors
            raise TokenizerError(f"cannot load tokenizer from {tok_file}: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json", required=False) or {}
        gen = _read_json(path / "generation_config.json", required=False) or {}
        special = {name: _token_content(config.get(name)) for name in _SPECIAL_NAMES}

        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            templates.update({t["name"]: t["template"] for t in raw})
        if (path / "chat_template.jinja").is_file():
            templates = {"default": (path / "chat_template.jinja").read_text(encoding="utf-8")}
        for extra in sorted((path / "additional_chat_templates").glob("*.jinja")):
            templates[extra.stem] = extra.read_text(encoding="utf-8")

        # add_bos_token/add_eos_token are deliberately not applied: transformers (v5) drops them whenever
        # tokenizer.json exists, so its post-processor alone decides which BOS/EOS encode() adds.
        gen_eos = gen.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(tok, special, templates, extra_eos_ids=gen_eos, bos_token_id=gen.get("bos_token_id"))

    @classmethod
    def from_tokenizer(cls, tok: _HFTokenizer, *, eos_token: str | None, bos_token: str | None,
                       chat_template: str | None = None) -> Tokenizer:
        """Wrap an in-memory `tokenizers.Tokenizer` (the caller keeps its post-processor as is)."""
        special = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": None, "unk_token": None}
        return cls(tok, special, {"default": chat_template} if chat_template else {})

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json so `transformers.AutoTokenizer` loads the same tokenizer."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            # transformers may otherwise post-edit decoded text and disagree with decode() here.
            "clean_up_tokenization_spaces": False,
            **{k: v for k, v in self.special_tokens.items() if v is not None},
        }
        if list(self.chat_templates) == ["default"]:
            config["chat_template"] = self.chat_templates["default"]
        elif self.chat_templates:
            config["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_templates.items()]
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                    encoding="utf-8")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; `add_special_tokens` applies the post-processor (e.g. a leading BOS). Text that
        is not valid Unicode (a lone UTF-16 surrogate, which JSON's ``\\ud800`` escapes can carry) raises
        TokenizerError naming where."""
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            problem = not_unicode(text) if isinstance(text, str) else None
            if problem is not None:
                raise TokenizerError(problem) from None
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; ids outside the vocabulary are skipped (padded model vocabularies can sample them)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings for `ids`; an unknown id raises TokenizerError."""
        tokens = [self._tok.id_to_token(i) for i in ids]
        if None in tokens:
            raise TokenizerError(f"token id {ids[tokens.index(None)]} is not in the vocabulary of {self.vocab_size}")
        return tokens

    def is_special(self, token_id: int) -> bool:
        """True when decode(skip_special_tokens=True) drops this id."""
        return token_id in self._special_ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` with the checkpoint's chat template, as transformers does (tokenize=False).

        Extra kwargs (tools, documents, enable_thinking, ...) are passed to the template. A template named
        "tool_use" is chosen when tools are given, like transformers.
        """
        name = "tool_use" if kwargs.get("tools") and "tool_use" in self.chat_templates else "default"
        if name not in self.chat_templates:
            if not self.chat_templates:
                raise TokenizerError("this tokenizer has no chat template")
            raise TokenizerError(f"no default chat template; templates present: {sorted(self.chat_templates)}")
        try:
            if name not in self._compiled:
                self._compiled[name] = compile_template(self.chat_templates[name])
            return self._compiled[name].render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                **{**{k: v for k, v in self.special_tokens.items() if v is not None}, **kwargs})
        except TemplateError as exc:
            raise TokenizerError(f"chat template error: {exc}") from exc


def _set_post_processor(tok: _HFTokenizer, bos: str | None, eos: str | None) -> None:
    # Same template transformers builds in TokenizersBackend.update_post_processor.
    bos = bos if bos is not None and tok.token_to_id(bos) is not None else None
    eos = eos if eos is not None and tok.token_to_id(eos) is not None else None
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    specials = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def build_byte_tokenizer(extra_special: Sequence[str] = ("<s>", "</s>", "<pad>")) -> Tokenizer:
    """A byte-level BPE tokenizer without merges, for tiny test checkpoints and the in-process default model.

    Ids 0..len(extra_special)-1 are the special tokens in the given order, then one token per byte value (id
    len(extra_special) + byte). bos is '<s>' and eos '</s>' when listed; encode() prepends bos when
    add_special_tokens. The chat template is ChatML-like plain text ending each turn with eos.
    """
    # ByteLevel.alphabet() is an unordered set; GPT-2's byte->char table gives byte b the id offset + b.
    byte_map = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(extra_special)}
    vocab.update({byte_map[b]: len(extra_special) + b for b in range(256)})
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(extra_special))
    bos = "<s>" if "<s>" in extra_special else None
    eos = "</s>" if "</s>" in extra_special else None
    _set_post_processor(tok, bos, None)
    # Newlines live inside expressions because trim_blocks would eat those following a block tag.
    template = (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\\n' + message['content'] + (eos_token or '') + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    )
    out = Tokenizer.from_tokenizer(tok, eos_token=eos, bos_token=bos, chat_template=template)
    if "<pad>" in extra_special:
        out.special_tokens["pad_token"] = "<pad>"
    return out


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for raw bytes, which the ByteLevel pre-tokenizer/decoder use.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
