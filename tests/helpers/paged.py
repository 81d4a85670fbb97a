"""A minimal paged-KV driver for model tests: block tables, slot mapping, AttentionMetadata.

It plays the scheduler + runner in a few lines: each `step` takes (seq_id, new tokens)
pairs, allocates blocks from a shuffled free list (so block tables are non-contiguous,
as after real allocation churn), runs one flat forward and returns each sequence's logits.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata
from worker_svc.models.config import ModelConfig


class PagedKV:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int = 64,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def metadata(self, batch: list[tuple[str, int]]) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata and positions for `batch` = [(seq_id, num_new_tokens)], allocating blocks."""
        bs = self.block_size
        slots: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for seq_id, n in batch:
            table = self.tables.setdefault(seq_id, [])
            start = self.lens.get(seq_id, 0)
            end = start + n
            while len(table) * bs < end:
                table.append(self.free.pop())
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            positions += range(start, end)
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(list(table))
            self.lens[seq_id] = end
        width = max(len(t) for t in tables)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        dev = self.device
        padded = [t + [0] * (width - len(t)) for t in tables]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return meta, torch.tensor(positions, dtype=torch.long, device=dev)

    @torch.inference_mode()
    def step(self, model: torch.nn.Module, batch: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """One forward over all of `batch`'s new tokens; logits [n_new, vocab] per sequence."""
        meta, positions = self.metadata([(seq_id, len(toks)) for seq_id, toks in batch])
        ids = torch.tensor([t for _, toks in batch for t in toks], dtype=torch.long, device=self.device)
        hidden = model(ids, positions, self.kv_caches, meta)
        logits = model.compute_logits(hidden)
        return list(logits.split([len(toks) for _, toks in batch]))


@torch.inference_mode()
def nll_and_greedy(  # type: ignore[no-untyped-def]
    model, cfg, ids: list[int], prompts: list[list[int]], n_new: int, dtype: torch.dtype = torch.float32
) -> tuple[float, list[list[int]]]:
    """(mean next-token NLL over `ids` in one prefill, each prompt's greedy continuation of n_new
    tokens), every forward reading its own K/V back from a paged cache of `dtype`."""
    (logits,) = PagedKV(cfg, num_blocks=64, block_size=16, dtype=dtype).step(model, [("text", ids)])
    nll = F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).item()
    outs = []
    for i, prompt in enumerate(prompts):
        kv = PagedKV(cfg, num_blocks=16, block_size=16, dtype=dtype, seed=i)
        toks, new = list(prompt), list(prompt)
        for _ in range(n_new):
            (lg,) = kv.step(model, [("p", new)])
            new = [int(lg[-1].argmax())]
            toks += new
        outs.append(toks[len(prompt) :])
    return nll, outs
