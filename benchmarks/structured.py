"""Structured outputs: grammar compile time per schema, and per-step cost of constrained decoding.

    python -m benchmarks.structured                       # CPU, the embedded SmolLM2
    python -m benchmarks.structured --device cuda --model llama-3.1-8b   # H100, dummy 8B weights

Sections:
- compile: llguidance (the engine llmesh uses) and, when installed, xgrammar: one-off tokenizer
  set-up, compile time of each of the 20 test schemas (tests/data/structured_schemas.json), and
  the time to fill one token mask (vocab 49152) along random walks through each grammar;
- steps: decode time per step, free vs constrained (every row held to a regex that never ends, so
  that each run lasts exactly --tokens steps), at each --batch; the overhead is what the bitmask
  costs where the GPU waits for it. A constrained row is launched ahead like any other: its mask
  is filled while the GPU runs its forward, one step behind (`LaunchedStep.deferred`), and
  applied by one Triton pass. Unless --no-compare, the paths before run too, in the same
  process: `lexer_families(llm, 1)` (every sequence of a spec a copy of one template, so a
  batch's fill runs one row at a time behind its lexer's lock), a column with twice the lexer
  families and fill threads, `fill_in_finish` (the masks filled, and the sampling queued, on the
  step thread before the step before's result is handed over) and `mask_in_step` (no
  launch-ahead for constrained rows, the mask applied by torch ops). On CUDA each row also counts
  the steps where the device ran out of work: a forward queued after the last sampling had run,
  or a sampling queued after its logits were ready, and times the fills. With --timeline, CUDA
  events split each step's device time into the forward (with its logits), the wait for the
  sampling to be queued, the sampling, and the wait for the next forward (`DeviceTimeline`):
  where a constrained step's extra time goes. --marginal adds runs of twice --tokens (a step's
  cost without a run's fixed costs); --profile DIR writes torch.profiler traces of a free, a
  constrained and a one-family run at the largest batch and reads them (`benchmarks.trace_gaps`);
- fill: a batch's first fill after each row's first token (nothing cached), outside the engine,
  by lexer families x fill threads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

SCHEMAS = pathlib.Path(__file__).parents[1] / "tests" / "data" / "structured_schemas.json"
V_SMOL = 49152


def _walk(fill, accept, stopped, mask, vocab: int, rng: random.Random, steps: int = 64) -> list[float]:
    import torch

    times = []
    bits_of = torch.arange(vocab)
    for _ in range(steps):
        if stopped():
            break
        t = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t)
        row = mask[0]
        ok = ((row[bits_of >> 5] >> (bits_of & 31).to(torch.int32)) & 1).nonzero().flatten().tolist()
        tok = rng.choice(ok)
        if not accept(tok) or tok == 2:
            break
    return times


def compile_section(hf: Any, num_schemas: int | None = None) -> list[tuple[str, str]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    from services.structured_outputs import StructuredOutputs, parser_limits

    schemas = json.loads(SCHEMAS.read_text())[:num_schemas]
    rows = []
    t = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=V_SMOL)
    took = f"{(time.perf_counter() - t) * 1e3:.0f} ms"
    rows.append(("llguidance tokenizer set-up (once per worker)", took))
    comp, masks = [], []
    for i, s in enumerate(schemas):
        so = StructuredOutputs(json=s)
        t = time.perf_counter()
        m = llguidance.LLMatcher(tok, so.to_llguidance(), limits=parser_limits())
        comp.append(time.perf_counter() - t)
        bm = lt.allocate_token_bitmask(1, V_SMOL)
        masks += _walk(
            lambda m=m, bm=bm: lt.fill_next_token_bitmask(m, bm, 0),
            m.consume_token,
            m.is_stopped,
            bm,
            V_SMOL,
            random.Random(i),
        )
    rows += _stats("llguidance", comp, masks)
    try:
        import xgrammar as xgr
    except ImportError:
        rows.append(("xgrammar", "not installed (pip install xgrammar to compare)"))
        return rows
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V_SMOL)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    rows.append(("xgrammar tokenizer set-up", f"{(time.perf_counter() - t) * 1e3:.0f} ms"))
    comp, masks = [], []
    for i, s in enumerate(schemas):
        t = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(s), any_whitespace=False)
        comp.append(time.perf_counter() - t)
        m = xgr.GrammarMatcher(cg)
        bm = xgr.allocate_token_bitmask(1, V_SMOL)
        masks += _walk(
            lambda m=m, bm=bm: m.fill_next_token_bitmask(bm),
            m.accept_token,
            m.is_terminated,
            bm,
            V_SMOL,
            random.Random(i),
        )
    rows += _stats("xgrammar", comp, masks)
    return rows


def fill_section(hf: Any, vocab: int, rows: int = 32, reps: int = 3) -> list[tuple[str, str]]:
    """A batch's first fill after each row's first token (no row's mask cached: the costly fill
    of every run of the steps section), outside the engine, by lexer families x fill threads:
    copies of one template share its lexer and the lock around it."""
    import resource

    from llmesh import StructuredOutputs
    from worker_svc.structured import StructuredOutputManager, executor_threads

    spec = StructuredOutputs(regex=r"[a-zA-Z ,.]*")
    words = hf.encode(" the cat sat on a mat and then it went home to see", add_special_tokens=False)
    k = max(2, executor_threads())
    out = []
    for families, threads in ((1, 1), (1, k), (k, k), (2 * k, 2 * k)):
        m = StructuredOutputManager(lambda: hf, vocab, [0], families=families, fill_threads=threads)
        first, cpu, nxt = [], [], []
        for rep in range(reps + 1):  # the first warms the templates and the executor
            gs = [m.start(spec) for _ in range(rows)]
            m.bitmask(gs)  # each row's first mask: its template's, inherited
            for i, g in enumerate(gs):
                assert g.accept(words[i % len(words)])
            r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            m.bitmask_async(gs).result()
            wall, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
            t = time.perf_counter()
            m.bitmask_async(gs).result()
            if rep:
                first.append(wall)
                cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
                nxt.append(time.perf_counter() - t)
        m.close()
        out.append(
            (
                f"first fill, {rows} rows, {families} lexer families x {threads} threads",
                f"{statistics.median(first) * 1e3:.2f} ms (CPU of all threads "
                f"{statistics.median(cpu) * 1e3:.1f} ms); "
                f"the next fill {statistics.median(nxt) * 1e3:.2f} ms",
            )
        )
    return out


def _stats(name: str, comp: list[float], masks: list[float]) -> list[tuple[str, str]]:
    ms = sorted(masks)
    return [
        (
            f"{name} compile per schema ({len(comp)})",
            f"median {statistics.median(comp) * 1e3:.2f} ms, max {max(comp) * 1e3:.2f} ms",
        ),
        (
            f"{name} mask fill per token ({len(ms)} tokens)",
            f"median {statistics.median(ms) * 1e6:.0f} us, p99 {ms[int(0.99 * len(ms))] * 1e6:.0f} us",
        ),
    ]


@contextlib.contextmanager
def mask_in_step(llm: Any) -> Iterator[None]:
    """The path before issue 31, for comparison in the same process: a constrained row is not
    launched ahead (its whole step waits for the token in flight to reach the host, and the
    mask is filled between two GPU steps) and the mask is applied by torch ops (the twin)."""
    from kernels.reference import apply_token_bitmask_

    runner = llm.engine.runner
    follow = runner.can_follow

    def can_follow(plan: Any) -> bool:
        for s in plan.scheduled:
            st = runner.seqs.get(s.seq_id)
            if st is not None and st.grammar is not None and st.inflight is not None:
                return False
        return follow(plan)

    def torch_ops(logits: Any, bitmask: Any) -> None:
        apply_token_bitmask_(logits, runner.sampler._upload(bitmask))

    runner.can_follow = can_follow
    runner.sampler._apply_bitmask = torch_ops
    try:
        yield
    finally:
        del runner.can_follow, runner.sampler._apply_bitmask


@contextlib.contextmanager
def fill_in_finish(llm: Any) -> Iterator[None]:
    """The path before the fill thread, for comparison in the same process: the step thread fills
    the next step's masks and queues its sampling before it hands over the step's result."""
    runner = llm.engine.runner

    def fill_and_sample(launched: Any) -> None:
        sample, launched.deferred = launched.deferred, None
        launched.sampled = sample(runner.structured.bitmask([st.grammar for st in launched.sampling]))

    runner._fill_masks = fill_and_sample
    try:
        yield
    finally:
        del runner._fill_masks


@contextlib.contextmanager
def lexer_families(llm: Any, families: int, threads: int | None = None) -> Iterator[None]:
    """Sequences started meanwhile are copies of `families` independent templates of their spec
    (1: the path before, every row of a spec behind its template's lexer lock), their masks
    filled by `threads` threads (default: as many as now)."""
    so = llm.engine.runner.structured
    before = so.families, so.fill_threads, so._executor
    so.families = families
    if threads is not None and threads != so.fill_threads:
        so.fill_threads, so._executor = threads, None  # a new executor of that many threads
    try:
        yield
    finally:
        so.families, so.fill_threads, so._executor = before


@contextlib.contextmanager
def device_starved(llm: Any) -> Iterator[dict[str, int]]:
    """Counts, on CUDA, the forwards queued when the device had finished the last sampling queued,
    and the samplings queued when their logits were already computed: steps the host held up;
    and the caching allocator's retries and device frees (each frees cached blocks, which waits
    for the device) and device allocations meanwhile."""
    import torch

    runner = llm.engine.runner
    counts = {"forwards": 0, "forward late": 0, "samplings": 0, "sampling late": 0}
    if not torch.cuda.is_available():
        yield counts
        return
    ex, sampler = runner.executor, runner.sampler
    forward, logits, sample, verify = ex.forward, ex.logits, sampler.sample_async, sampler.verify_async
    fill = runner.structured._fill
    fills: list[float] = []

    def timed_fill(*a: Any) -> None:
        t = time.perf_counter()
        try:
            fill(*a)
        finally:
            fills.append(time.perf_counter() - t)

    last: dict[str, Any] = {"sampled": None, "logits": None}
    allocator = ("num_alloc_retries", "num_device_free", "num_device_alloc")
    before = {k: torch.cuda.memory_stats().get(k, 0) for k in allocator}

    def late(event: Any) -> bool:
        return event is not None and event.query()

    def fwd(*a: Any, **k: Any) -> Any:
        counts["forwards"] += 1
        counts["forward late"] += late(last["sampled"])
        return forward(*a, **k)

    def lgt(*a: Any, **k: Any) -> Any:
        out = logits(*a, **k)
        last["logits"] = torch.cuda.Event()
        last["logits"].record()
        return out

    def sampling(fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            counts["samplings"] += 1
            counts["sampling late"] += late(last["logits"])
            out = fn(*a, **k)
            last["sampled"] = out.done_event
            return out

        return run

    ex.forward, ex.logits = fwd, lgt
    sampler.sample_async, sampler.verify_async = sampling(sample), sampling(verify)
    runner.structured._fill = timed_fill
    try:
        yield counts
    finally:
        del ex.forward, ex.logits, sampler.sample_async, sampler.verify_async, runner.structured._fill
        counts["fills"] = len(fills)
        counts["fill max us"] = int(max(fills, default=0.0) * 1e6)
        counts["fill total us"] = int(sum(fills) * 1e6)
        for k in allocator:
            counts[k] = torch.cuda.memory_stats().get(k, 0) - before[k]


class DeviceTimeline:
    """CUDA timing events around each forward (entry, after its logits) and each sampling (entry,
    after its last op), read back after a run. The device reaches an event once the work before it
    is done, or once the host recorded it if that is later: the span from one event to the next is
    the device's work between them plus any time it had nothing queued. Steps alternate forward,
    sampling in stream order on every path of this benchmark."""

    PARTS = ("forward", "until sampling queued", "sampling", "until next forward")

    def __init__(self, llm: Any) -> None:
        import torch

        self._torch = torch
        self._runner = llm.engine.runner
        self.events: list[tuple[str, Any]] = []
        self.totals = dict.fromkeys(self.PARTS, 0.0)  # ms, summed over the runs read
        self.steps = 0

    def _mark(self, name: str) -> None:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append((name, event))

    def __enter__(self) -> DeviceTimeline:
        ex, sampler = self._runner.executor, self._runner.sampler
        forward, logits = ex.forward, ex.logits
        sample, verify = sampler.sample_async, sampler.verify_async

        def fwd(*a: Any, **k: Any) -> Any:
            self._mark("f")
            return forward(*a, **k)

        def lgt(*a: Any, **k: Any) -> Any:
            out = logits(*a, **k)
            self._mark("l")
            return out

        def sampling(fn: Any) -> Any:
            def run(*a: Any, **k: Any) -> Any:
                self._mark("s")
                out = fn(*a, **k)
                self._mark("e")
                return out

            return run

        ex.forward, ex.logits = fwd, lgt
        sampler.sample_async, sampler.verify_async = sampling(sample), sampling(verify)
        return self

    def __exit__(self, *exc: Any) -> None:
        ex, sampler = self._runner.executor, self._runner.sampler
        del ex.forward, ex.logits, sampler.sample_async, sampler.verify_async

    def read(self) -> None:
        """Add the events recorded since the last read (one run: nothing between runs counts)."""
        self._torch.cuda.synchronize()
        ev = self.events
        names = "".join(name for name, _ in ev)
        i = names.find("flse")
        while i >= 0:
            f, lg, s, e = (ev[i + j][1] for j in range(4))
            self.totals["forward"] += f.elapsed_time(lg)
            self.totals["until sampling queued"] += lg.elapsed_time(s)
            self.totals["sampling"] += s.elapsed_time(e)
            if names.startswith("f", i + 4):
                self.totals["until next forward"] += e.elapsed_time(ev[i + 4][1])
            self.steps += 1
            i = names.find("flse", i + 4)
        self.events = []

    def summary(self) -> str:
        per = {k: v / max(self.steps, 1) for k, v in self.totals.items()}
        return ", ".join(f"{k} {v:.3f}" for k, v in per.items()) + f" ms per step ({self.steps} steps)"


def step_section(
    llm: Any,
    batches: list[int],
    tokens: int,
    reps: int,
    compare: bool,
    timeline: bool = False,
    marginal_too: bool = False,
) -> list[tuple[str, str]]:
    from llmesh import SamplingParams, StructuredOutputs

    # Never complete, so every run lasts exactly `tokens` steps; letters and spaces keep the mask
    # non-trivial (about a third of the vocabulary allowed).
    spec = StructuredOutputs(regex=r"[a-zA-Z ,.]*")
    modes = [("free", None, contextlib.nullcontext), ("constrained", spec, contextlib.nullcontext)]
    if compare:
        threads = llm.engine.runner.structured.fill_threads
        if llm.engine.runner.structured.families > 1:  # one already on a machine of few cores
            modes.append(("constrained, one lexer family (before)", spec, lambda: lexer_families(llm, 1)))
        modes.append(
            (
                f"constrained, {2 * threads} families x {2 * threads} threads",
                spec,
                lambda: lexer_families(llm, 2 * threads, 2 * threads),
            )
        )
        modes.append(("constrained, fill in finish (before)", spec, lambda: fill_in_finish(llm)))
        modes.append(("constrained, mask in the step (before)", spec, lambda: mask_in_step(llm)))
    rows = []
    for b in batches:
        prompts = [[1 + (i * 7 + j) % 1000 for j in range(16)] for i in range(b)]
        per, outs, starved, spans, marginal = {}, {}, {}, {}, {}
        for label, so, path in modes:
            sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=so)
            with path():
                llm.generate(prompts, sp, use_tqdm=False)  # warm-up (and the grammar compile)
                best = float("inf")
                with device_starved(llm) as starved[label]:
                    for _ in range(reps):
                        t = time.perf_counter()
                        out = llm.generate(prompts, sp, use_tqdm=False)
                        best = min(best, time.perf_counter() - t)
                if timeline:  # runs of their own: the events cost host time
                    with DeviceTimeline(llm) as spans[label]:
                        for _ in range(reps):
                            llm.generate(prompts, sp, use_tqdm=False)
                            spans[label].read()
                # Twice the steps: what a step costs without each run's fixed costs.
                if marginal_too and label in ("free", "constrained"):
                    sp2 = SamplingParams(
                        temperature=0, max_tokens=2 * tokens, ignore_eos=True, structured_outputs=so
                    )
                    best2 = float("inf")
                    for _ in range(reps):
                        t = time.perf_counter()
                        llm.generate(prompts, sp2, use_tqdm=False)
                        best2 = min(best2, time.perf_counter() - t)
                    marginal[label] = (best2 - best) / tokens
            per[label] = best / tokens
            outs[label] = [o.outputs[0].token_ids for o in out]
        for label in per:
            if label != "free":
                over = per[label] / per["free"] - 1
                rows.append(
                    (
                        f"batch {b}: ms per step free / {label}",
                        f"{per['free'] * 1e3:.2f} / {per[label] * 1e3:.2f}  ({over * 100:+.1f} %)",
                    )
                )
            if label in marginal:
                over = marginal[label] / marginal["free"] - 1
                rows.append(
                    (
                        f"batch {b}: {label}: ms per step, {tokens} more steps a run",
                        f"{marginal[label] * 1e3:.2f}  ({over * 100:+.1f} % of free)",
                    )
                )
            if label in spans:
                rows.append((f"batch {b}: {label}: device timeline", spans[label].summary()))
            c = starved[label]
            if c["forwards"]:
                rows.append(
                    (
                        f"batch {b}: {label}: device starved",
                        f"forward late {c['forward late']} of {c['forwards']}, "
                        f"sampling late {c['sampling late']} of {c['samplings']}; allocator "
                        f"retries {c['num_alloc_retries']}, frees {c['num_device_free']}, "
                        f"allocs {c['num_device_alloc']}; fills {c['fills']}: longest "
                        f"{c['fill max us'] / 1e3:.2f} ms, all {c['fill total us'] / 1e3:.1f} ms",
                    )
                )
        if compare:
            same = all(
                outs["constrained"] == outs[label] for label in outs if label.startswith("constrained")
            )
            rows.append((f"batch {b}: constrained tokens the same every way", str(same)))
    return rows


def profile_section(llm: Any, batch: int, tokens: int, out_dir: str) -> list[tuple[str, str]]:
    """torch.profiler traces (CUDA activity only: the host's own overhead stays small) of one
    free and one constrained run at `batch`, written to `out_dir`, and what each shows
    (`benchmarks.trace_gaps`): the device's busy and idle time a step, and the idle's place."""
    import gzip

    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.trace_gaps import analyse, load, step_times
    from llmesh import SamplingParams, StructuredOutputs

    os.makedirs(out_dir, exist_ok=True)
    prompts = [[1 + (i * 7 + j) % 1000 for j in range(16)] for i in range(batch)]
    rows = []
    spec = StructuredOutputs(regex=r"[a-zA-Z ,.]*")
    paths = (
        ("free", None, contextlib.nullcontext),
        ("constrained", spec, contextlib.nullcontext),
        ("one_family", spec, lambda: lexer_families(llm, 1)),
    )
    for label, so, path in paths:
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=so)
        with path():
            llm.generate(prompts, sp, use_tqdm=False)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, sp, use_tqdm=False)
                torch.cuda.synchronize()
        raw = os.path.join(out_dir, f"trace_{label}_b{batch}.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(raw)
        rows.append((f"batch {batch}: {label}: profile", "\n" + analyse(load(raw + ".gz"))))
        rows.append((f"batch {batch}: {label}: device time a step", step_times(load(raw + ".gz"))))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2", help="smollm2 (embedded) or llama-3.1-8b (dummy weights)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sections", default="compile,steps")
    ap.add_argument(
        "--no-compare", action="store_true", help="skip the path before issue 31 (mask filled between steps)"
    )
    ap.add_argument(
        "--timeline", action="store_true", help="CUDA events: where each step's device time goes (extra runs)"
    )
    ap.add_argument(
        "--marginal",
        action="store_true",
        help="runs of twice --tokens too: a step without a run's fixed costs",
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="CUDA: torch.profiler traces of a free and a constrained run at the largest batch, into DIR",
    )
    ap.add_argument("--profile-tokens", type=int, default=16)
    ap.add_argument("--smollm2", default=None, help="SmolLM2 .gguf or folder (default: the embedded package)")
    ap.add_argument("--smoke", action="store_true", help="3 schemas, batch 2, 4 tokens (make test)")
    args = ap.parse_args()
    num_schemas = None
    if args.smoke:
        num_schemas, args.batch, args.tokens, args.reps = 3, [2], 4, 1

    from llmesh import LLM
    from services.model_files import load_tokenizer, resolve_model

    smol = resolve_model(args.smollm2, None)
    hf = load_tokenizer(smol)
    rows: list[tuple[str, str]] = []
    if "compile" in args.sections:
        rows += compile_section(hf, num_schemas)
    if "fill" in args.sections:
        from benchmarks.gpu import SHAPES

        vocab = SHAPES[args.model]["vocab_size"] if args.model != "smollm2" else V_SMOL
        rows += fill_section(hf, vocab, max(args.batch))
    if "steps" in args.sections:
        kw: dict[str, Any] = dict(device=args.device, max_num_seqs=max(args.batch), max_model_len=1024)
        tmp = None
        if args.model == "smollm2":
            path = smol
        else:
            from benchmarks.gpu import SHAPES, write_config

            tmp = tempfile.mkdtemp()
            path = write_config(tmp, args.model, SHAPES[args.model])
            for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                if os.path.exists(os.path.join(smol, f)):
                    shutil.copy(os.path.join(smol, f), path)  # a tokenizer for the grammar engine
            kw.update(load_format="dummy", dtype="bfloat16" if args.device == "cuda" else "float32")
        llm = LLM(path, **kw)
        timeline = args.timeline and args.device.startswith("cuda")
        rows += step_section(
            llm, args.batch, args.tokens, args.reps, not args.no_compare, timeline, args.marginal
        )
        if args.profile and args.device.startswith("cuda"):
            rows += profile_section(llm, max(args.batch), args.profile_tokens, args.profile)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    print(f"structured outputs, device={args.device}, model={args.model}")
    for item, value in rows:
        print(f"  {item:<{width}}  {value}")


if __name__ == "__main__":
    main()
