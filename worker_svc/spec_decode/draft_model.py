"""Draft-model proposals: a smaller model with the target's vocabulary, run by the same worker.

Its paged KV cache has the target's block count and block size, so the target's block ids
and slots address it too: no second block table, nothing for the scheduler to track. It is
kept in step with the target by running on exactly the target's inputs in every forward (the
executor's eager forward and the decode CUDA graphs call `forward_alongside`), so before proposing for a
sequence it holds the KV of every token but the newest.

Proposals are greedy (the draft's argmax): a deterministic draft is a one-hot q, which the
verifier's accept rule expects, and the output stays exactly the target's. They are made at
the start of the plan that verifies them, not after the sample before it: only then are the
blocks of the positions the draft writes allocated. The worker reports `num_draft_tokens`
right after the sample all the same (a draft model always proposes all it is asked for).

The KV of blocks loaded from the host tier or the KV store holds the target's layers only;
the draft's are stale there, which lowers acceptance for such prefixes but never changes
the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_cache
from worker_svc.loader import load_model
from worker_svc.sampler import rows_argmax
from worker_svc.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from worker_svc.executor import ModelExecutor
    from worker_svc.runner import ModelRunner, SequenceState


class DraftModel:
    def __init__(self, spec: SpeculativeConfig, target: ModelExecutor) -> None:
        """Load the draft beside `target` (rank 0's executor, its model loaded) on its device."""
        cfg = target.config
        self.model, self.model_config = load_model(
            spec.model or target.model_path,
            dtype=target.dtype,
            device=target.device,
            backend=target.backend,
            load_format=cfg.load_format,
            cache_dir=cfg.cache_dir,
            num_layers=spec.num_layers,
        )
        target_vocab = target.model_config.vocab_size
        if self.model_config.vocab_size != target_vocab:
            raise ValueError(
                f"the draft model's vocabulary ({self.model_config.vocab_size}) is not the target's "
                f"({target_vocab}): they must share a tokenizer"
            )
        self.kv_spec = KVCacheSpec.of(self.model_config, cfg.block_size, target.dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.vocab_size = target_vocab

    def allocate(self, num_blocks: int, device: torch.device) -> None:
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, device)

    def forward_alongside(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write the draft's KV for the target's inputs of this forward (its output is not needed)."""
        self.model(ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def propose(self, runner: ModelRunner, seqs: list[SequenceState], ks: list[int]) -> list[list[int]]:
        """ks[i] greedy draft tokens after each sequence's last token, one batched decode per position."""
        bs = runner.config.block_size
        table = runner.block_table
        rows = np.asarray([st.row for st in seqs], dtype=np.int64)
        start = np.asarray([len(st.token_ids) - 1 for st in seqs], dtype=np.int64)
        last = np.asarray([st.token_ids[-1] for st in seqs], dtype=np.int64)
        want = np.asarray(ks, dtype=np.int64)
        drafts: list[list[int]] = [[] for _ in seqs]
        for step in range(int(want.max(initial=0))):
            act = np.flatnonzero(want > step)
            n = act.shape[0]
            positions = start[act] + step
            seq_lens = positions + 1
            num_blocks = -(-int(seq_lens.max()) // bs)
            width = min((num_blocks + 15) // 16 * 16, table.shape[1])  # as the runner: few variants
            tables = table[rows[act], :width]
            slots = table[rows[act], positions // bs].astype(np.int64) * bs + positions % bs
            d_ids, d_pos, d_slots, d_qsl, d_lens, d_tables = runner.upload(
                [
                    last[act],
                    positions,
                    slots,
                    np.arange(n + 1, dtype=np.int32),
                    seq_lens.astype(np.int32),
                    tables,
                ]
            )
            meta = AttentionMetadata(
                slot_mapping=d_slots,
                query_start_loc=d_qsl,
                seq_lens=d_lens,
                block_tables=d_tables,
                max_query_len=1,
                max_seq_len=int(seq_lens.max()),
                query_lens_cpu=[1] * n,
                seq_lens_cpu=seq_lens.tolist(),
            )
            hidden = self.model(d_ids, d_pos, self.kv_caches, meta)
            tokens = rows_argmax(self.model.compute_logits(hidden)[:, : self.vocab_size]).tolist()
            for j, i in enumerate(act.tolist()):
                drafts[i].append(tokens[j])
                last[i] = tokens[j]
        return drafts
