"""Incremental detokenization and stop-string matching, shared by the gateway and the offline API.

Decoding token by token breaks multi-byte characters and merged pieces, so we
decode a short window (from `prefix_offset`) and emit only the text beyond what
the window up to `read_offset` already produced, holding back while the tail is
an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        out = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                piece = full[len(prefix) :]
                out.append(piece)
                # The tokens just read become the left context of the next decode.
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
        new = "".join(out)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of a stream: emit whatever is held back, replacement chars included."""
        full = self._decode(self.token_ids[self.prefix_offset :])
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        self.read_offset = len(self.token_ids)
        rest = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.text += rest
        return rest

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def find_stop(text: str, new_len: int, stops: list[str]) -> int:
    """Index in `text` where the earliest stop string begins, or -1.

    Only the last `new_len` characters are new, so a match must end inside them.
    """
    best = -1
    for stop in stops:
        start = max(len(text) - new_len - len(stop) + 1, 0)
        idx = text.find(stop, start)
        if idx != -1 and (best == -1 or idx < best):
            best = idx
    return best


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters might still become a stop string (hold them from streams)."""
    keep = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                keep = max(keep, n)
                break
    return keep
