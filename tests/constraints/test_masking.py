"""The sample stage's token mask: the project's C++ kernel and xgrammar's own apply give the same logits for every
dtype; unconstrained rows are untouched and rows whose mask allows nothing are reported, not masked."""

from __future__ import annotations

import pytest
import torch

from litellm_pipeline.constraints import masking
from litellm_pipeline.constraints.grammar import Grammars, bitmask_words
from litellm_pipeline.model import cpu_kernels
from litellm_pipeline.text.tokenizer import build_byte_tokenizer


@pytest.fixture(params=["kernel", "xgrammar"])
def path(request, monkeypatch):
    if request.param == "kernel":
        try:
            cpu_kernels.ops()
        except Exception as exc:  # a machine without a compiler: the xgrammar path is what runs there
            pytest.skip(f"the CPU kernels cannot be built here: {cpu_kernels.reason(exc)}")
    else:
        monkeypatch.setattr(cpu_kernels, "loaded", lambda: None)
    return request.param


class Bits:
    """A matcher that writes a fixed bitmask row."""

    def __init__(self, row: torch.Tensor):
        self.row = row

    def fill_bitmask(self, bitmask, i):
        bitmask[i] = self.row


def test_only_constrained_rows_change_and_dead_rows_are_reported(path):
    tok = build_byte_tokenizer()
    g = Grammars(tok, tok.vocab_size, [1])
    logits = torch.randn(4, tok.vocab_size)
    before = logits.clone()
    digit = g.regex("[0-9]").matcher()
    # the dead row's only set bits lie past the vocabulary: they say nothing
    dead_bits = torch.zeros(bitmask_words(tok.vocab_size), dtype=torch.int32)
    dead_bits[-1] = -(1 << (tok.vocab_size % 32))
    dead = masking.mask_logits(logits, [(1, digit), (3, Bits(dead_bits))])
    assert dead == [3]
    assert torch.equal(logits[[0, 2, 3]], before[[0, 2, 3]])
    digits = {3 + ord(str(d)) for d in range(10)}
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == digits
    assert torch.equal(logits[1, sorted(digits)], before[1, sorted(digits)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [259, 32000, 32001])
def test_kernel_equals_xgrammar(dtype, vocab):
    import xgrammar as xgr

    try:
        ns = cpu_kernels.ops()
    except Exception as exc:
        pytest.skip(f"the CPU kernels cannot be built here: {cpu_kernels.reason(exc)}")
    g = torch.Generator().manual_seed(vocab)
    bm = torch.randint(-(2**31), 2**31 - 1, (6, bitmask_words(vocab)), dtype=torch.int32, generator=g)
    bm[:, 3] = 0  # whole words banned and allowed
    bm[:, 4] = -1
    rows = [0, 2, 5]
    ours = torch.randn(6, vocab, generator=g).to(dtype)
    ref = ours.clone()
    assert list(ns.apply_token_bitmask_(ours, bm, torch.tensor(rows))) == []
    xgr.apply_token_bitmask_inplace(ref, bm, vocab_size=vocab, indices=rows)
    assert torch.equal(ours, ref)
    assert torch.isinf(ours[rows]).any() and not torch.isinf(ours[[1, 3, 4]]).any()
