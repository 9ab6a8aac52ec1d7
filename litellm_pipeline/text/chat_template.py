"""Chat templates: a checkpoint's Jinja template rendered as transformers renders it (``tokenize=False``), in a
sandbox (templates ship with checkpoints and are untrusted code), with transformers' own ``tojson``,
``raise_exception``, ``strftime_now`` and ``{% generation %}`` tag."""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TemplateError = jinja2.exceptions.TemplateError


class _GenerationTag(jinja2.ext.Extension):
    # Some templates mark assistant turns with {% generation %}; transformers only uses it for masks, so render as-is.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Same override as transformers: jinja's own tojson HTML-escapes, which would change the rendered prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _make_env() -> ImmutableSandboxedEnvironment:
    # Chat templates ship with checkpoints and are untrusted code, hence the sandbox.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_template(source: str) -> jinja2.Template:
    """The template ready to ``render(messages=..., add_generation_prompt=..., **special_tokens)``; raises
    :data:`TemplateError` for a template that does not parse."""
    return _make_env().from_string(source)
