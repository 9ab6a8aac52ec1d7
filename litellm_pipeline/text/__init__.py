"""Text in and out: the tokenizer (``tokenizer.json`` through the ``tokenizers`` library), chat templates
(the checkpoint's Jinja template, rendered as transformers renders it) and incremental detokenization for
streaming (:mod:`~litellm_pipeline.text.tokenizer`)."""
