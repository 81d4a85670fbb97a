"""N-gram (prompt lookup) proposals: continue the sequence the way it went after an earlier match.

For the last n tokens (n from prompt_lookup_max down to prompt_lookup_min), find their most
recent earlier occurrence in prompt + output that k tokens follow, and propose those tokens. Edits,
extractions and summaries copy long spans of the prompt, so these drafts are often right and
cost no model at all.

Host work per sequence and step is O(occurrences of the last token), on a numpy mirror of the
tokens that grows with the sequence (no list -> array conversion of the whole history per step).
"""

from __future__ import annotations

import numpy as np


class _TokenMirror:
    """An append-only int32 copy of a growing token list."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int32)
        self.n = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        if len(tokens) < self.n:  # the list was replaced by a shorter one (a new life): start over
            self.n = 0
        if len(tokens) > self.buf.shape[0]:
            grown = np.empty(max(len(tokens), 2 * self.buf.shape[0]), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if len(tokens) > self.n:
            self.buf[self.n : len(tokens)] = tokens[self.n :]
            self.n = len(tokens)
        return self.buf[: self.n]


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    length = tokens.shape[0]
    if k <= 0 or length < min_n + 1:
        return []
    # Candidate match ends: earlier positions holding the last token (never the last itself).
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if ends.size == 0:
        return []
    # Grow each candidate's match backwards, one position per round, up to max_n tokens.
    matched = np.ones(ends.shape[0], dtype=np.int64)
    alive = np.ones(ends.shape[0], dtype=bool)
    for j in range(1, min(max_n, length - 1)):
        alive &= ends >= j
        if not alive.any():
            break
        alive[alive] = tokens[ends[alive] - j] == tokens[length - 1 - j]
        matched += alive
    best = matched.max()
    if best < min_n:
        return []
    # The most recent of the longest matches that is followed by k tokens; if none is, the one
    # followed by the most (in a repeating pattern the latest match is right before the end).
    longest = ends[matched == best]
    full = longest[longest + k < length]
    end = int(full[-1]) if full.size else int(longest[0])
    return tokens[end + 1 : min(end + 1 + k, length)].tolist()


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._mirrors: dict[str, _TokenMirror] = {}

    def propose(self, seq_id: str, tokens: list[int], k: int) -> list[int]:
        mirror = self._mirrors.get(seq_id)
        if mirror is None:
            mirror = self._mirrors[seq_id] = _TokenMirror()
        return propose_ngram(mirror.sync(tokens), k, self.min_n, self.max_n)

    def forget(self, seq_id: str) -> None:
        self._mirrors.pop(seq_id, None)

    def forget_all(self) -> None:
        self._mirrors.clear()
