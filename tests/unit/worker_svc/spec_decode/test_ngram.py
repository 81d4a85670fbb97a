"""N-gram proposals and `--speculative-config` parsing."""

from __future__ import annotations

import numpy as np
import pytest

from worker_svc.spec_decode.config import SpeculativeConfig
from worker_svc.spec_decode.ngram import NgramProposer, propose_ngram


def ngram(tokens: list[int], k: int, lo: int = 2, hi: int = 5) -> list[int]:
    return propose_ngram(np.asarray(tokens, dtype=np.int32), k, lo, hi)


def test_continues_after_the_longest_earlier_match() -> None:
    assert ngram([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], 3) == [4, 5, 9]
    # [2, 3] also occurs later, but [1, 2, 3] is the longer match.
    assert ngram([1, 2, 3, 4, 5, 9, 2, 3, 7, 7, 1, 2, 3], 3) == [4, 5, 9]


def test_most_recent_match_among_equally_long_ones() -> None:
    assert ngram([7, 8, 1, 7, 8, 2, 7, 8], 1) == [2]


def test_needs_prompt_lookup_min_tokens_of_match() -> None:
    assert ngram([5, 1, 6, 2, 3, 1], 2) == []  # only the last token matches
    assert ngram([5, 1, 6, 2, 3, 1], 2, lo=1, hi=1) == [6, 2]


def test_short_or_matchless_sequences_propose_nothing() -> None:
    assert ngram([1], 4) == []
    assert ngram([1, 2, 3, 4], 4) == []
    assert ngram([1, 2, 1, 2], 0) == []


def test_a_repeating_pattern_is_continued_for_k_tokens() -> None:
    assert ngram([4, 4, 4, 4], 3) == [4]  # no match with 3 tokens after it: the longest tail
    assert ngram([4] * 9, 3) == [4, 4, 4]
    assert ngram([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2]  # the earliest match: 3 tokens follow
    assert ngram([9, 1, 2, 5, 6, 7, 8, 1, 2, 5, 1, 2], 2) == [5, 1]  # the latest with 2 after it


def test_proposer_mirror_follows_a_growing_sequence_and_a_new_life() -> None:
    p = NgramProposer(2, 3)
    tokens = [1, 2, 3, 9, 1, 2]
    assert p.propose("a", tokens, 2) == [3, 9]
    tokens += [3, 9, 5, 1, 2]
    assert p.propose("a", tokens, 2) == [3, 9]
    assert p.propose("a", [6, 7, 6, 7], 2) == [6, 7]  # a shorter list: a new sequence under the id
    p.forget("a")
    assert p.propose("a", list(range(600)) + [0, 1], 1) == [2]  # grows past its first buffer


def test_config_from_json_dict_and_errors() -> None:
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert spec is not None
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 2, 3)
    as_dict = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert as_dict is not None and as_dict.num_speculative_tokens == 2
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    for bad, match in (
        ("{not json", "JSON"),
        ("[1]", "object"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
         "lookup"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown keys"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "num_layers"),
    ):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)
