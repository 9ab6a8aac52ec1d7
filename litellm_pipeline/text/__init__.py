"""Text in and out: the tokenizer (``tokenizer.json`` through the ``tokenizers`` library, special tokens), chat
templates (the checkpoint's Jinja template, rendered as transformers renders it) and incremental detokenization
for streaming."""
