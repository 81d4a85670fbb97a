"""Decode attention at short contexts: the decode graphs' split-K plan against no split.

    python3 benchmarks/split_k_short.py [--batches 1,4] [--contexts 160,256,512,1024,2048]

The decode graphs freeze the attention's split count at capture, sized for the longest context
(`max_seq_len = max_model_len`), so a batch-1 step at 160 tokens still launches 32 segments and
the merge. Is a second set of graphs, unsplit for short contexts, worth capturing? For each
(query heads / KV heads, batch, context) this times, in one CUDA graph of 20 back-to-back calls
(the mean over 50 replays):
* split: the plan the graphs capture (the heuristic's count for a 131,072-token limit), merge
  included;
* unsplit: one segment per sequence, no merge.
One GPU, bf16, head_dim 128, block size 16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.triton.paged_attention import _choose_num_splits, paged_attention  # noqa: E402

BLOCK_SIZE, HEAD_DIM = 16, 128
GRAPH_LIMIT = 131072  # the context the graphs' split count is sized for
CALLS, REPLAYS = 20, 50


def time_call(
    b: int, heads: int, kv_heads: int, context: int, unsplit: bool, device: str = "cuda"
) -> tuple[float, int]:
    """(us per attention call, segments) for a pure-decode batch of b sequences of `context` tokens."""
    dev = torch.device(device)
    blocks = -(-context // BLOCK_SIZE)
    cache = torch.randn(2, b * blocks + 1, BLOCK_SIZE, kv_heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    q = torch.randn(b, heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(b, dtype=torch.long, device=dev),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((b,), context, dtype=torch.int32, device=dev),
        block_tables=(torch.arange(b * blocks, device=dev, dtype=torch.int32) + 1).view(b, blocks),
        max_query_len=1,
        max_seq_len=GRAPH_LIMIT,
        query_lens_cpu=[1] * b,
        seq_lens_cpu=[context] * b,
    )
    splits = 1 if unsplit else _choose_num_splits(meta, kv_heads, dev)
    out = torch.empty_like(q)
    if dev.type == "cpu":  # --smoke: the kernel interpreted, one wall-clock call (checks, not speed)
        t0 = time.perf_counter()
        paged_attention(q, cache, meta, HEAD_DIM**-0.5, out, num_splits=splits)
        return (time.perf_counter() - t0) * 1e6, splits
    for _ in range(3):  # compile and warm outside the capture
        paged_attention(q, cache, meta, HEAD_DIM**-0.5, out, num_splits=splits)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            paged_attention(q, cache, meta, HEAD_DIM**-0.5, out, num_splits=splits)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS), splits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="32/8,16/4,32/4", help="query/KV heads per GPU: 8B, 8B TP 2, 70B TP 2")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--contexts", default="160,256,512,1024,2048")
    ap.add_argument("--smoke", action="store_true", help="one tiny cell on the CPU, the kernel interpreted")
    args = ap.parse_args(argv)
    device = "cuda"
    if args.smoke:
        device, args.heads, args.batches, args.contexts = "cpu", "2/1", "1", "48"
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreted, one call, no graph)"
    print(f"{where}: us per decode attention call (in a CUDA graph)")
    print(f"{'heads':>7} {'batch':>5} {'context':>7} {'split (segments)':>17} {'unsplit':>8}")
    for pair in args.heads.split(","):
        heads, kv_heads = (int(x) for x in pair.split("/"))
        for b in (int(x) for x in args.batches.split(",")):
            for context in (int(x) for x in args.contexts.split(",")):
                t_split, segments = time_call(b, heads, kv_heads, context, unsplit=False, device=device)
                t_one, _ = time_call(b, heads, kv_heads, context, unsplit=True, device=device)
                print(f"{pair:>7} {b:>5} {context:>7} {t_split:>11.2f} ({segments:>2}) {t_one:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
