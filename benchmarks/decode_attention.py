"""One layer's decode attention at long contexts against the copy bandwidth (issue 31).

    python3 benchmarks/decode_attention.py [--contexts 8192,32768,122880] [--sweep] [--out DIR]
    python3 benchmarks/decode_attention.py --batched 256x600 --uneven 0.8  # a serving batch's spread
    python3 benchmarks/decode_attention.py --smoke          # CPU, Triton interpreted, tiny shapes

Decode reads each sequence's K and V once: floor = K/V bytes / copy bandwidth (read + write of
a large device copy, measured in the same run). Each row times `paged_attention` on one layer
(32 query / 8 KV heads, D = 128, block size 16: the Llama-3.1-8B shape) for batch 1 (and a few
small batches) as a CUDA graph over enough distinct caches (>= 256 MiB together) that every
call reads HBM, not L2, with block tables in random order. Rows per cache dtype (bf16, fp8):

* `unified (before)`: the path before issue 31's decode kernel (LLMESH_PAGED_DECODE=unified's);
* `default (now)`: `paged_attention` as it dispatches now (`paged_decode.takes_decode_kernel`);
* `decode kernel`: `kernels.triton.paged_decode` with its picked config and splits;
* diagnostics: the default config at other split counts (batch 1) or unsplit (batches), with
  the merge fused into the kernel, and the split kernel alone (merge skipped, output unchecked);
  where the default splits each tile between the warps (`DecodeConfig.warp_split`), the plain
  programs beside it;
* with --sweep, at --sweep-contexts: the decode kernel over (tile, pipelining depth, warps)
  x split counts x fused merge, best first.

Every timed variant is first checked on the GPU against the PyTorch twin
(`kernels.reference.paged_attention`, fp32): ||out - ref|| / ||ref|| is printed per row.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu import gpu_time  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.triton import paged_decode as pd  # noqa: E402

pa_mod = importlib.import_module("kernels.triton.paged_attention")


@dataclasses.dataclass
class Case:
    batch: int
    ctx: int
    kv: str  # "bf16" or "fp8"


def _copy_bw(dev: str, mib: int) -> float:
    n = (mib << 20) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    t = gpu_time(lambda: dst.copy_(src), reps=20, warmup=1)
    return 2 * src.numel() * 2 / t


def context_lens(case: Case, sigma: float) -> list[int]:
    """Every sequence at `case.ctx`; with `sigma` > 0 (batches only), lognormal contexts of mean
    `case.ctx` clipped to [1, 8 x ctx], seeded: a serving batch's spread, where a launch lasts as
    long as its longest program (uniform batches favoured small programs the engine then ran
    slower: docs/benchmarks.md, "The fp8 codes as words")."""
    if sigma <= 0 or case.batch == 1:
        return [case.ctx] * case.batch
    x = torch.empty(case.batch).log_normal_(0.0, sigma, generator=torch.Generator().manual_seed(case.batch))
    return [int(v) for v in (x / x.mean() * case.ctx).round().clamp(1, 8 * case.ctx)]


class Workload:
    """`n_rot` independent (q, cache blocks, metadata) sets for one case, sharing one cache tensor."""

    def __init__(self, case: Case, args: argparse.Namespace) -> None:
        dev, bs, hkv, d = args.device, args.block_size, args.kv_heads, args.head_dim
        self.dtype = torch.float8_e4m3fn if case.kv == "fp8" else torch.bfloat16
        lens = context_lens(case, args.uneven)
        self.bytes = sum(lens) * hkv * d * 2 * self.dtype.itemsize  # K + V read
        rot_bytes = args.rotate_mib << 20
        self.n_rot = max(1, math.ceil(rot_bytes / self.bytes)) if dev == "cuda" else 1
        need = [-(-n // bs) for n in lens]
        per_set, width = sum(need), max(need)
        total = self.n_rot * per_set
        cache = torch.randn((2, total, bs, hkv, d), dtype=torch.bfloat16, device=dev)
        self.cache = cache.to(self.dtype)
        del cache
        # Power-of-two scales as the worker calibrates them; not 1.0, so a dropped scale shows.
        self.kv_scale = reference.unit_kv_scale(dev) if case.kv == "fp8" else None
        if self.kv_scale is not None:
            self.kv_scale = torch.tensor([0.5, 2.0, 2.0, 0.5], dtype=torch.float32, device=dev)
        perm = torch.randperm(total, dtype=torch.int32)
        self.sets = []
        self.in_order = {}  # the same sets over blocks in allocation order (a fresh cache)
        for r in range(self.n_rot):
            scattered = torch.zeros(case.batch, width, dtype=torch.int32)
            in_order = torch.zeros(case.batch, width, dtype=torch.int32)
            first = r * per_set
            for i, n in enumerate(need):
                scattered[i, :n] = perm[first : first + n]
                in_order[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
                first += n
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(case.batch, dtype=torch.long, device=dev),
                query_start_loc=torch.arange(case.batch + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                block_tables=scattered.to(dev),
                max_query_len=1,
                max_seq_len=max(lens),
                query_lens_cpu=[1] * case.batch,
                seq_lens_cpu=list(lens),
            )
            # Scores with a standard deviation of ~3: a peaked softmax, not a plain mean of V.
            q = 3 * torch.randn(case.batch, args.heads, d, dtype=torch.bfloat16, device=dev)
            self.sets.append((q, meta, torch.empty_like(q)))
            self.in_order[id(meta)] = dataclasses.replace(meta, block_tables=in_order.to(dev))
        self.scale = d**-0.5
        self.ref: torch.Tensor | None = None

    def error(self, call) -> float:  # type: ignore[no-untyped-def]
        """||out - ref|| / ||ref|| on the first set, the output poisoned (NaN) before the call."""
        q, meta, out = self.sets[0]
        out.fill_(float("nan"))
        call(q, meta, out)
        if self.ref is None:
            self.ref = reference.paged_attention(q.float(), self.cache, meta, self.scale, self.kv_scale)
        return float((out.float() - self.ref).norm() / self.ref.norm())

    def seconds(self, call, dev: str, reps: int) -> float:  # type: ignore[no-untyped-def]
        def run_all() -> None:
            for q, meta, out in self.sets:
                call(q, meta, out)

        if dev != "cuda":  # the interpreter (smoke): one untimed-quality run is enough
            t0 = time.perf_counter()
            run_all()
            return (time.perf_counter() - t0) / self.n_rot
        run_all()  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
        t = gpu_time(graph.replay, reps=reps, warmup=1) / self.n_rot
        del graph
        return t


def _unified(w: Workload):  # type: ignore[no-untyped-def]
    def call(q, meta, out) -> None:  # type: ignore[no-untyped-def]
        saved = pa_mod._UNIFIED_DECODE
        pa_mod._UNIFIED_DECODE = True
        try:
            pa_mod.paged_attention(q, w.cache, meta, w.scale, out=out, kv_scale=w.kv_scale)
        finally:
            pa_mod._UNIFIED_DECODE = saved

    return call


def _decode(w: Workload, config: pd.DecodeConfig | None = None, splits: int | None = None):  # type: ignore[no-untyped-def]
    def call(q, meta, out) -> None:  # type: ignore[no-untyped-def]
        if config is None and splits is None:
            pa_mod.paged_attention(q, w.cache, meta, w.scale, out=out, kv_scale=w.kv_scale)
        else:
            pd.paged_decode(
                q, w.cache, meta, w.scale, out, num_splits=splits, kv_scale=w.kv_scale, config=config
            )

    return call


ROWS: list[dict] = []


def _row(case: Case, variant: str, t: float, err: float, w: Workload, bw: float, splits: int) -> None:
    r = {
        "batch": case.batch,
        "ctx": case.ctx,
        "kv": case.kv,
        "variant": variant,
        "splits": splits,
        "us": t * 1e6,
        "tbps": w.bytes / t / 1e12,
        "of_copy": w.bytes / t / bw,
        "floor_us": w.bytes / bw * 1e6,
        "err": err,
    }
    ROWS.append(r)
    print(
        f"{case.batch:>3} x {case.ctx:>6} {case.kv:>4} {variant:<34} {r['us']:9.1f} us  "
        f"{r['tbps']:5.2f} TB/s  {r['of_copy']:5.0%} of copy  floor {r['floor_us']:7.1f} us  "
        f"err {err:.1e}",
        flush=True,
    )


def _sweep_configs(args: argparse.Namespace, kv: str) -> list[tuple[pd.DecodeConfig, int]]:
    """(tile, stages, warps) triples of --sweep-bf16 / --sweep-fp8 x --sweep-splits x fused merge."""
    # Trailing letters: "w" the fp8 codes read as int32 words (DecodeConfig.kv_words), "l" the
    # longest contexts launched first (DecodeConfig.longest_first), "s" each tile split between
    # the warps (DecodeConfig.warp_split; words only).
    triples = [
        (*(int(v) for v in x.rstrip("wls").split("/")), "w" in x, "l" in x, "s" in x)
        for x in (args.sweep_fp8 if kv == "fp8" else args.sweep_bf16).split(",")
    ]
    splits = [int(x) for x in args.sweep_splits.split(",")]
    fused = [bool(int(x)) for x in args.sweep_fused.split(",")]
    return [
        (
            pd.DecodeConfig(
                t, nw, st, dot_f16=kv == "fp8", fused_merge=m, kv_words=w, longest_first=lf, warp_split=ws
            ),
            n,
        )
        for (t, st, nw, w, lf, ws), n, m in itertools.product(triples, splits, fused)
        if not (ws and m)  # warp-split programs always merge apart
    ]


def _in_order(w: Workload, call):  # type: ignore[no-untyped-def]
    """`call` over the workload's blocks in allocation order (output unchecked: other K/V)."""

    def run(q, meta, out) -> None:  # type: ignore[no-untyped-def]
        call(q, w.in_order[id(meta)], out)

    return run


def _without_merge(call):  # type: ignore[no-untyped-def]
    """`call` with the split path's merge launch skipped: the split kernel's time alone (wrong output)."""

    def run(q, meta, out) -> None:  # type: ignore[no-untyped-def]
        saved = pa_mod.merge_attn_partials
        pa_mod.merge_attn_partials = lambda *a, **k: None
        try:
            call(q, meta, out)
        finally:
            pa_mod.merge_attn_partials = saved

    return run


def _variants(case: Case, w: Workload, args: argparse.Namespace) -> list[tuple[str, object, int, bool]]:
    """(label, call, splits, checked against the twin) for one case."""
    dev = torch.device(args.device)
    meta = w.sets[0][1]
    fp8 = case.kv == "fp8"
    base, n_def = pd.plan_decode(meta, args.kv_heads, args.head_dim, fp8, dev)
    n_old = pa_mod._choose_num_splits(meta, args.kv_heads, dev)
    takes = pd.takes_decode_kernel(meta, args.kv_heads, fp8, dev, None)
    now = f"default (now: {'decode kernel' if takes else 'unified'})"
    out = [("unified (before)", _unified(w), n_old, True), (now, _decode(w), n_def if takes else n_old, True)]
    if not takes:  # the decode kernel's own choice, for comparison
        out.append(("decode kernel (its config)", _decode(w, base, n_def), n_def, True))
    plain = base
    if base.warp_split:  # the programs before it, side by side
        first = pd.pick_decode_config(args.head_dim, fp8)
        plain = dataclasses.replace(first, longest_first=base.longest_first)
        out.append(("decode kernel (plain programs)", _decode(w, plain, n_def), n_def, True))
    if fp8:  # the other way of reading the codes (plain programs: warp-split ones need words)
        other = dataclasses.replace(plain, kv_words=not plain.kv_words)
        label = f"decode kernel ({'byte codes' if plain.kv_words else 'int32 words'})"
        out.append((label, _decode(w, other, n_def), n_def, True))
    if n_def > 1:  # the fused merge: plain programs (warp-split ones merge apart)
        other = dataclasses.replace(plain, fused_merge=not plain.fused_merge)
        label = "decode kernel (merge launched apart)" if plain.fused_merge else "decode kernel (fused merge)"
        out.append((label, _decode(w, other, n_def), n_def, True))
        alone = _without_merge(_decode(w, dataclasses.replace(base, fused_merge=False), n_def))
        out.append(("decode kernel (no merge: kernel alone)", alone, n_def, False))
    out.append(("unified (before), blocks in order", _in_order(w, _unified(w)), n_old, False))
    out.append(("decode kernel, blocks in order", _in_order(w, _decode(w, base, n_def)), n_def, False))
    if case.batch > 1:
        out.append(("decode kernel (unsplit)", _decode(w, base, 1), 1, True))
    else:
        for n in (int(x) for x in args.diag_splits.split(",") if x):
            if n != n_def:
                out.append((f"decode kernel ({n} splits)", _decode(w, base, n), n, True))
    swept = case.batch == 1 and case.ctx in args.sweep_contexts
    if args.sweep and (swept or (case.batch, case.ctx) in args.sweep_batched):
        if fp8:  # what the fp16 conversion buys: the default with bf16 dots
            bf16_dots = dataclasses.replace(base, dot_f16=False)
            out.append(("default, bf16 dots", _decode(w, bf16_dots, n_def), n_def, True))
        for cfg, n in _sweep_configs(args, case.kv):
            label = f"t{cfg.tile} s{cfg.num_stages} w{cfg.num_warps}{' f16' if cfg.dot_f16 else ''} sp{n}"
            label += " words" if cfg.kv_words else ""
            label += " longest first" if cfg.longest_first else ""
            label += " warp split" if cfg.warp_split else ""
            label += " fused" if cfg.fused_merge else ""
            out.append((label, _decode(w, cfg, n), n, True))
    return out


def run(args: argparse.Namespace) -> None:
    dev = args.device
    bw = _copy_bw(dev, args.copy_mib)
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreted)"
    spread = f"lognormal contexts, sigma {args.uneven}, mean C" if args.uneven > 0 else "every context C"
    print(f"device: {gpu}; copy bandwidth {bw / 1e12:.2f} TB/s; batches B x C: {spread}", flush=True)
    cases = [Case(1, c, kv) for c in args.contexts for kv in args.kv_dtypes]
    cases += [Case(b, c, kv) for b, c in args.batched for kv in args.kv_dtypes]
    for case in cases:
        w = Workload(case, args)
        for label, call, n, checked in _variants(case, w, args):
            try:
                err = w.error(call) if checked else float("nan")
                t = w.seconds(call, dev, args.reps)
            except Exception as e:  # a config that does not compile (shared memory): keep the table
                print(f"{case} {label}: ERROR {repr(e)[:200]}", flush=True)
                continue
            _row(case, label, t, err, w, bw, n)
        del w
        if dev == "cuda":
            torch.cuda.empty_cache()
    _table(gpu, bw)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_attention.json"), "w") as f:
            json.dump({"gpu": gpu, "copy_bw": bw, "rows": ROWS}, f, indent=1)
    bad = [r for r in ROWS if r["err"] == r["err"] and not r["err"] < args.max_err]  # NaN: unchecked
    if bad:
        sys.exit(f"{len(bad)} rows off the twin by more than {args.max_err}: {bad[:3]}")


def _table(gpu: str, bw: float) -> None:
    print(f"\n## decode attention, one layer (32/8 heads, D=128, block 16): {gpu}, copy {bw / 1e12:.2f} TB/s")
    print("| batch x context | KV | variant | splits | time | K/V read | of copy BW | err |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    keyed: dict[tuple, list[dict]] = {}
    for r in ROWS:
        keyed.setdefault((r["batch"], r["ctx"], r["kv"]), []).append(r)
    for rows in keyed.values():
        fixed = [r for r in rows if "(" in r["variant"]]
        best = sorted((r for r in rows if "(" not in r["variant"]), key=lambda r: r["us"])[:8]
        for r in fixed + best:
            print(
                f"| {r['batch']} x {r['ctx']} | {r['kv']} | {r['variant']} | {r['splits']} | "
                f"{r['us']:.1f} us | {r['tbps']:.2f} TB/s | {r['of_copy']:.0%} | {r['err']:.1e} |"
            )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="8192,32768,122880")
    ap.add_argument("--batched", default="4x32768,16x8192,64x2048", help="BxC cases beside batch 1")
    ap.add_argument("--kv-dtypes", default="bf16,fp8")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rotate-mib", type=int, default=256)
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time the decode kernel's config grid too")
    ap.add_argument("--sweep-contexts", default="32768,122880")
    ap.add_argument("--sweep-batched", default="", help="BxC cases swept too")
    ap.add_argument("--sweep-fused", default="0,1", help="the sweep's fused-merge settings")
    ap.add_argument("--sweep-bf16", default="128/4/4,64/6/4,64/2/4,32/6/4,64/4/2,64/6/2,32/4/2,128/6/8")
    ap.add_argument(
        "--sweep-fp8", default="128/6/4,128/4/4,64/6/4,64/4/2,64/6/2,32/6/4,128/6/8,64/5/4ws,32/6/2ws"
    )
    ap.add_argument("--sweep-splits", default="16,32,64,128", help="tile/stages/warps triples and splits")
    ap.add_argument("--diag-splits", default="16,32,64,128", help="batch 1: the default config at these too")
    ap.add_argument(
        "--uneven", type=float, default=0.0, help="batches: lognormal contexts of this sigma around BxC's C"
    )
    ap.add_argument("--max-err", type=float, default=2e-2, help="largest ||out - ref|| / ||ref|| accepted")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreted)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        args.contexts, args.batched, args.heads, args.kv_heads, args.head_dim = "100", "2x40", 2, 1, 16
        args.sweep, args.sweep_contexts, args.reps, args.copy_mib, args.rotate_mib = True, "100", 1, 8, 1
        args.sweep_batched, args.sweep_bf16, args.sweep_fp8 = "2x40", "32/2/4", "32/2/4,32/2/4wl,32/2/2ws"
        args.uneven = 0.5
        args.sweep_splits, args.diag_splits = "2", ""
        args.out = None
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    args.sweep_contexts = [int(x) for x in args.sweep_contexts.split(",") if x]
    args.batched = [tuple(int(v) for v in x.split("x")) for x in args.batched.split(",") if x]
    args.sweep_batched = [tuple(int(v) for v in x.split("x")) for x in args.sweep_batched.split(",") if x]
    args.kv_dtypes = args.kv_dtypes.split(",")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --smoke for a CPU dry run)")
    run(args)


if __name__ == "__main__":
    main()
