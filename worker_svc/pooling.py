"""Pooling sequences (embeddings, vLLM's encode/embed): prompts pooled, nothing sampled.

A pooling sequence (`SamplingParams.pooling`) is a prompt prefilled like any other, in chunks
if the planner splits it; its final hidden states (the model's final norm applied, as vLLM's
poolers read them) are pooled as its chunks go through: a running sum for mean pooling, the
first row for CLS, the last row for last-token pooling. When a step completes its prompt the
vector goes back in `StepResult.pooled`, and the sequence never samples: its row is taken out
of the step's sampled rows before the forward (`drop_pooling_samples`).

Steps with a pooling sequence run eagerly (their hidden rows lie sequence after sequence,
`num_new` each); every other step keeps its graphs. The model's default pooling comes from the
worker's --pooling-type, else the folder's sentence-transformers config, else last-token
(decoder-only embedding models).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from services.sampling_params import SamplingParams
from services.step import PooledOutput

# sentence-transformers' Pooling config keys -> ours (the first set to true wins).
_ST_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}


def default_pooling(model_path: str, flag: str | None = None) -> str:
    """The model's pooling: `flag` (the worker's --pooling-type), else the folder's
    sentence-transformers Pooling module's mode, else last-token."""
    if flag:
        return flag
    root = pathlib.Path(model_path)
    try:
        modules = json.loads((root / "modules.json").read_text())
        pooling = next(m for m in modules if str(m.get("type", "")).endswith("Pooling"))
        config = json.loads((root / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
        return "last"
    return next((ours for key, ours in _ST_MODES.items() if config.get(key)), "last")


class PoolingSequence(Protocol):
    """What is read of a sequence (`runner.SequenceState`), before its step is counted in."""

    seq_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams


class StepShape(Protocol):
    """What `drop_pooling_samples` rewrites of a step (`step_inputs.StepInputs`)."""

    forward: object  # rank_channel.ForwardInputs
    sample_seqs: list[int]
    verified: list[list[int]]
    outputs_before: list[int]


def drop_pooling_samples(step: StepShape, order: Sequence[tuple[PoolingSequence, int]]) -> None:
    """Take the pooling sequences out of the step's sampled rows (they sample nothing)."""
    keep = [j for j, i in enumerate(step.sample_seqs) if order[i][0].params.pooling is None]
    if len(keep) == len(step.sample_seqs):
        return
    fwd = step.forward
    index = fwd.sample_index if fwd.sample_index is not None else np.arange(len(fwd.ids), dtype=np.int64)  # type: ignore[attr-defined]
    # A verifying sequence samples one row per draft and one after them.
    per_seq = np.asarray([len(d) + 1 for d in step.verified], dtype=np.int64)
    first = np.cumsum(per_seq) - per_seq
    rows = [r for j in keep for r in range(first[j], first[j] + per_seq[j])]
    fwd.sample_index = index[np.asarray(rows, dtype=np.int64)]  # type: ignore[attr-defined]
    fwd.num_sampled = len(keep)  # type: ignore[attr-defined]
    step.sample_seqs = [step.sample_seqs[j] for j in keep]
    step.verified = [step.verified[j] for j in keep]
    step.outputs_before = [step.outputs_before[j] for j in keep]


class Pooler:
    """The pooling sequences' partial pools (on the device) between the chunks of their prompts."""

    def __init__(self, default: str) -> None:
        self.default = default
        self._partial: dict[str, torch.Tensor] = {}

    def forget(self, seq_id: str) -> None:
        self._partial.pop(seq_id, None)

    def forget_all(self) -> None:
        self._partial.clear()

    def take(
        self, hidden: torch.Tensor, order: Sequence[tuple[PoolingSequence, int]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Fold this eager step's rows in; the vectors (fp32, on the device) of prompts it completes."""
        done = []
        offset = 0
        for st, num_new in order:
            if st.params.pooling is not None:
                vec = self._fold(st, hidden[offset : offset + num_new])
                if vec is not None:
                    done.append((st.seq_id, vec))
            offset += num_new
        return done

    def _fold(self, st: PoolingSequence, rows: torch.Tensor) -> torch.Tensor | None:
        kind = st.params.pooling if st.params.pooling != "default" else self.default
        start, end = st.num_computed_tokens, st.num_computed_tokens + len(rows)
        partial = self._partial.get(st.seq_id)
        if kind == "mean":
            chunk = rows.float().sum(dim=0)
            partial = chunk if partial is None else partial + chunk
        elif kind == "cls":
            if start == 0:
                partial = rows[0].float()
        else:  # last
            partial = rows[-1].float()
        if end < st.num_prompt_tokens:
            if partial is not None:
                self._partial[st.seq_id] = partial
            return None
        self._partial.pop(st.seq_id, None)
        assert partial is not None, "a pooled prompt is computed from its first token"
        return partial / st.num_prompt_tokens if kind == "mean" else partial


def pooled_outputs(done: list[tuple[str, torch.Tensor]]) -> list[PooledOutput]:
    """Read the vectors back (the step's host sync has happened or happens here)."""
    return [PooledOutput(seq_id, vec.cpu().tolist()) for seq_id, vec in done]
