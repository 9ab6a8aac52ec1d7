"""The demo model's character-level tokenizer: one token per character of the skills corpus, plus specials.

Ids 0..3 are ``<s>`` (bos, prepended by encode), ``</s>`` (eos), ``<pad>`` and ``<unk>`` (any character outside
:data:`~litellm_pipeline.demo.skills.CHARSET`); then one id per character in CHARSET order. Built with the
`tokenizers` library and saved through :class:`litellm_pipeline.text.tokenizer.Tokenizer`, so `transformers`'
AutoTokenizer reads the same files.
"""

from __future__ import annotations

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, processors

from litellm_pipeline.demo.skills import CHARSET
from litellm_pipeline.text.tokenizer import Tokenizer

# The demo model answers one skill prompt (12+345=, rev:abc=, sort:cab=, copy:xy=, a3,b7;b=) and never saw a
# conversation: its chat prompt is the last message, which must be the user's. System messages and earlier turns are
# not shown to it (it could not use them); an assistant message last (a reply to continue) is refused by name.
CHAT_TEMPLATE = (
    "{%- if not messages or messages[-1]['role'] != 'user' -%}"
    "{{ raise_exception('the demo model answers the last message, which must be a user message (it sees no system "
    "message and no earlier turn)') }}"
    "{%- endif -%}"
    "{{ bos_token }}{{ messages[-1]['content'] }}"
)

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIALS = (BOS, EOS, PAD, UNK)
BOS_ID, EOS_ID, PAD_ID, UNK_ID = range(len(SPECIALS))


def build_char_tokenizer(charset: str = CHARSET) -> Tokenizer:
    """One token per character of ``charset`` after the four specials; decode concatenates tokens. Carries
    :data:`CHAT_TEMPLATE`."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(dict.fromkeys(charset))})
    # BPE without merges and without a pre-tokenizer splits the text into single characters
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    out = Tokenizer.from_tokenizer(tok, eos_token=EOS, bos_token=BOS, chat_template=CHAT_TEMPLATE)
    out.special_tokens["pad_token"] = PAD
    out.special_tokens["unk_token"] = UNK
    return out
