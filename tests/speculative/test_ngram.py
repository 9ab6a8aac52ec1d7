"""Prompt lookup: the longest suffix found most recently, what followed it, never the suffix itself."""

from array import array

import pytest

from litellm_pipeline.speculative.ngram import NgramProposer


def look(tokens, k=3, max_n=3, min_n=1):
    return NgramProposer(None, max_n=max_n, min_n=min_n).lookup(array("i", tokens), k)


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # suffix [7, 8]: found at 0 (followed by 1, 2, 3); [8] alone is found later (followed by 9)
    assert look([7, 8, 1, 2, 3, 8, 9, 7, 8]) == [1, 2, 3]


def test_most_recent_occurrence_and_k():
    assert look([5, 1, 5, 2, 5], k=1) == [2]
    assert look([5, 1, 5, 2, 5], k=2) == [2, 5]  # what follows may run into the suffix itself


def test_no_match_and_too_short():
    assert look([1, 2, 3, 4]) == []
    assert look([1]) == []
    assert look([3, 3], k=4) == [3]  # only one token follows the earlier 3


def test_min_n_refuses_short_matches():
    assert look([7, 1, 2, 9, 7], min_n=2) == []
    assert look([7, 1, 2, 9, 7], min_n=1) == [1, 2, 9]


def test_byte_patterns_straddling_two_tokens_are_not_matches():
    # 256 = 00 01 00 00 and 1 = 01 00 00 00 (little-endian int32): the bytes of [1] appear inside 256's
    assert look([256, 0, 1]) == []
    assert look([256, 0, 1, 5, 1], k=1) == [5]


def test_bad_parameters():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(None, max_n=1, min_n=2)



def test_finished_requests_are_not_kept():
    from litellm_pipeline import LLM
    from litellm_pipeline.sampling import SamplingParams

    llm = LLM(overrides=["speculative=ngram"])
    sp = SamplingParams(max_tokens=8, temperature=0)
    outs = llm.generate(["copy:abc12=", "copy:x7z=", "sort:3917="], sp)
    stream = list(llm.stream("copy:q1w2=", sp))
    assert outs[0].text == "abc12" and "".join(d.text for d in stream) == "q1w2"
    assert llm.engine.speculator.proposer._seqs == {}  # their tokens (and the requests) went when they ended
