"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): which rows, and their values.

A forward computes hidden states for every scheduled token but takes logits of the sampled
rows only. A sequence that asks for prompt logprobs also needs the logits at each prompt
position whose next token is in the prompt: position p gives the logprob of prompt token p + 1.
A chunked prefill yields them chunk by chunk; the last prompt position is the sampled row and
gives none.

`prompt_rows` picks those rows (of an eager forward: the hidden states lie sequence after
sequence, `num_new` rows each); the runner takes their logits in the same call as the sampled
rows (so tensor-parallel ranks join one gather), and `PromptLogprobsPending` queues the
log-softmax, the prompt tokens' ranks and the top-k on the device, read back with the step.
Steps without such a sequence never reach this module, so their graphs and fast paths stay as
they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from services.sampling_params import SamplingParams
from services.step import PromptLogprobs, TokenLogprobs

_SLICE = 1024  # prompt rows per log-softmax


class PromptSequence(Protocol):
    """What is read of a sequence (`runner.SequenceState`), before its step is counted in."""

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams


@dataclass
class PromptRows:
    """The rows of one eager forward whose logits give prompt logprobs."""

    rows: np.ndarray  # int64, indices into the forward's hidden states
    targets: list[int]  # the prompt token each row predicts
    spans: list[tuple[str, int, int, int]]  # (seq_id, first prompt position, count, top-k)


def prompt_rows(order: Sequence[tuple[PromptSequence, int]]) -> PromptRows | None:
    """The prompt-logprob rows of a forward over `order` = [(sequence, new tokens)]; None: none."""
    rows: list[np.ndarray] = []
    targets: list[int] = []
    spans: list[tuple[str, int, int, int]] = []
    offset = 0
    for st, num_new in order:
        k = st.params.prompt_logprobs
        start = st.num_computed_tokens
        # Rows start .. end - 1 predict prompt tokens start + 1 .. end.
        end = min(start + num_new, st.num_prompt_tokens - 1)
        if k is not None and end > start:
            rows.append(np.arange(offset, offset + end - start, dtype=np.int64))
            targets.extend(st.token_ids[start + 1 : end + 1])
            spans.append((st.seq_id, start + 1, end - start, k))
        offset += num_new
    if not spans:
        return None
    return PromptRows(np.concatenate(rows), targets, spans)


class PromptLogprobsPending:
    """The values of a step's prompt rows, queued on the device; `wait` reads them back."""

    def __init__(self, logits: torch.Tensor, rows: PromptRows) -> None:
        """`logits`: [len(rows.rows), vocab], the raw logits of those rows."""
        self.spans = rows.spans
        self.targets = rows.targets
        self.k_max = max(k for _, _, _, k in rows.spans)
        target = torch.tensor(rows.targets, dtype=torch.int64, device=logits.device)
        # In slices of rows: a long prompt chunk's fp32 log-softmax is rows x vocab x 4 bytes,
        # and each slice's is freed before the next.
        packed = torch.cat(
            [
                self._rows(logits[i : i + _SLICE], target[i : i + _SLICE])
                for i in range(0, len(target), _SLICE)
            ]
        )
        # Read back with the step's results: one non-blocking copy, no sync here.
        self._host = packed.to("cpu", non_blocking=True)
        self._done = None
        if packed.is_cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    def _rows(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[rows, 2 + 2 k_max] fp32: the target's logprob, its rank, the top logprobs, their ids."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        tok_lp = lp.gather(1, target[:, None])
        parts = [tok_lp, (lp > tok_lp).sum(dim=-1, keepdim=True).to(torch.float32) + 1]
        if self.k_max:
            top_lp, top_ids = lp.topk(self.k_max, dim=-1)
            parts += [top_lp, top_ids.to(torch.float32)]  # ids < 2**24 are exact in fp32
        return torch.cat(parts, dim=1)

    def wait(self) -> list[PromptLogprobs]:
        if self._done is not None:
            self._done.synchronize()
        host = self._host.tolist()
        out = []
        r = 0
        km = self.k_max
        for seq_id, first, count, k in self.spans:
            entries = []
            for _ in range(count):
                row = host[r]
                entries.append(
                    TokenLogprobs(
                        token_id=self.targets[r],
                        logprob=row[0],
                        rank=int(row[1]),
                        top_token_ids=[int(t) for t in row[2 + km : 2 + km + k]],
                        top_logprobs=row[2 : 2 + k],
                    )
                )
                r += 1
            out.append(PromptLogprobs(seq_id, first, entries))
        return out
