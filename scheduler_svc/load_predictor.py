"""Whether loading a prefix from the KV store beats computing it again, from what was measured.

A store load runs before the forward that would otherwise compute those tokens, so it pays off
only if it takes less time than their prefill. Both sides are measured per worker, on the path
that worker actually uses (in place, shared memory, the bulk path from another host, gRPC):

- loads: each store load's blocks and wall seconds, as the worker reports them in its StepResult
  (through its MAC check, which waits for the bytes on the device), fitted as
  `seconds = overhead + blocks * seconds_per_block` over the last `WINDOW` loads;
- recompute: the scheduler's own timing of each step that computes prompt tokens (result
  arrival minus the later of its send and the previous result: the worker's busy time for it,
  less the store loads it reported), fitted as `seconds = fixed + tokens * seconds_per_token`;
  a load saves the marginal part, `tokens * seconds_per_token` (the step and its suffix run
  either way). Steps that loaded a prefix and computed only its tail are the short samples that
  tell the fixed part from the rate: through one size alone (the origin), a 256-token prefix
  of an 8B model looked twice as dear to compute as it is, and was loaded at a loss.

The decision (`decide`) loads the first k chunks of a hit, the k that saves the most predicted
time, or none: partial loads are allowed, the rest is computed in the same forward. The start is
conservative. Until a worker's loads are measured they are predicted, from the block size the
worker announces, at a prior bandwidth (`--kv-load-prior-gbps`, 1 GB/s: over gRPC between hosts
0.4-0.75 was measured, the bulk path 6-17, the same host's arena ~30); a hit the prior says not
to load gets one chunk (a probe, whose timing is the first sample). With no prefill measured yet
there is nothing to compare against, and the hit is loaded as before. A fit is not trusted far
past the sizes it was measured at (one size cannot tell a fixed overhead from a rate, and small
loads use fewer of the bulk path's connections): a hit more than `EXTRAPOLATE` times the largest
load measured, that the fit says to skip, gets a probe of twice that size. While loads are
skipped, every `PROBE_EVERY`-th skip still loads one chunk, so a path that got faster is
noticed; but a probe is a load predicted at a loss, which on a short prompt is a large share of
its first token (on an H200 a 256-token chunk of an 8B model took 14-16 ms over the bulk path, and
~8 ms to compute): a due probe waits for a request on which its predicted loss is at most
`PROBE_LOSS` of that request's predicted prefill (a long prompt whose leading chunk is stored), and
until one comes every request computes. A request whose whole prompt could not pay for a load skips
the store lookup too (`worth_looking`, decided from its length and the fitted rates before any RPC;
the lookup's own wait counts against loading): a skipped prompt costs nothing.

The prediction and its error are counted (KVTierStats -> WorkerStats -> the gateway's /metrics:
llmesh:kv_load_predicted_seconds, llmesh:kv_load_prediction_error_seconds, llmesh:kv_load_skipped).
Context length is not modelled: attention makes late tokens dearer to compute, which this
underestimates, so the predictor errs towards recomputing.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass

WINDOW = 64  # samples each fit keeps (the latest)
PROBE_EVERY = 16  # skipped loads in a row before one chunk is loaded anyway, to measure the path again
# ... on the first request where that chunk's predicted loss (load less the prefill it saves, and the
# lookup if it needs one) is at most this share of the request's predicted prefill.
PROBE_LOSS = 0.05
EXTRAPOLATE = 4  # a load this many times the largest measured is probed before it is skipped
# A sample this many times slower than the median of at least OUTLIER_NEIGHBOURS others of about
# its size (x within NEAR) is left out of its fit: a fresh worker's first steps (kernels loaded,
# compiled) ran ~2 s where their peers ran 30 ms, and one of them in the window tilted the prefill
# line enough that every 256-token chunk looked worth loading through the mesh (H100: 49.5 ms
# TTFT against 31.3 recomputed). A sample with few neighbours (a new size) always counts.
OUTLIER = 3.0
OUTLIER_NEIGHBOURS = 3
NEAR = 1.25
# Steps computing fewer prompt tokens than this say little about the prefill rate (decode-bound).
MIN_PREFILL_TOKENS = 32
# Bounds (seconds) of the prediction error histogram (|measured - predicted| per load).
ERROR_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LinearFit:
    """y = a + b * x by least squares over the last `window` samples (a >= 0, b >= 0).

    `flat_without_slope`: where the samples span several x but y does not grow with x beyond
    their noise, the fit is the flat line at the mean (x costs nothing measurable) instead of
    the line through the origin. For prefill that is the safe reading: a step whose time is its
    fixed cost (an eager 8B launch is ~18 ms of host work for 32 tokens or 288) gains nothing
    from a load, where the line through the origin charged all of it to the tokens (~60 us a
    token: a 256-token chunk looked worth a 13 ms load, and every short prompt loaded at a loss).
    """

    def __init__(self, window: int = WINDOW, flat_without_slope: bool = False) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.flat_without_slope = flat_without_slope
        self._fit: tuple[float, float] | None = None  # coefficients of the samples as they were
        self._fitted: tuple | None = None  # ... when these (adds, count, last sample) held
        self._adds = 0

    def add(self, x: float, y: float) -> None:
        if x > 0 and y >= 0:
            self.samples.append((float(x), float(y)))
            self._adds += 1

    def inliers(self) -> list[tuple[float, float]]:
        """The samples less the slow outliers (OUTLIER): sorted by x, each compared with the
        median of the others within NEAR of its x."""
        pts = sorted(self.samples)
        xs = [x for x, _ in pts]
        kept = []
        for i, (x, y) in enumerate(pts):
            lo, hi = bisect_left(xs, x / NEAR), bisect_right(xs, x * NEAR)
            near = [pts[j][1] for j in range(lo, hi) if j != i]
            if len(near) >= OUTLIER_NEIGHBOURS and y > OUTLIER * statistics.median(near):
                continue
            kept.append((x, y))
        return kept

    @property
    def measured(self) -> bool:
        return bool(self.samples)

    @property
    def max_x(self) -> float:
        return max((x for x, _ in self.samples), default=0.0)

    @property
    def spread(self) -> bool:
        """Whether the samples span more than one x (so overhead and rate can be told apart)."""
        xs = [x for x, _ in self.samples]
        return bool(xs) and max(xs) > 1.25 * min(xs)

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b); None before the first sample. With no spread in x: a line through 0. Slow
        outliers are left out (`inliers`); made again only once a sample has been added."""
        if not self.samples:
            return None
        key = (self._adds, len(self.samples), self.samples[-1])
        if self._fitted != key:
            self._fit, self._fitted = self._least_squares(self.inliers()), key
        return self._fit

    def _least_squares(self, samples: list[tuple[float, float]]) -> tuple[float, float]:
        n = len(samples)
        sx = sum(x for x, _ in samples)
        sy = sum(y for _, y in samples)
        mx, my = sx / n, sy / n
        var = sum((x - mx) ** 2 for x, _ in samples)
        through_zero = (0.0, sy / sx)
        if var <= 1e-9 * max(mx * mx, 1.0) * n:
            return through_zero
        b = sum((x - mx) * (y - my) for x, y in samples) / var
        a = my - b * mx
        if b <= 0:  # noise swamps the slope: flat at the mean, or the mean rate
            return (my, 0.0) if self.flat_without_slope else through_zero
        if a < 0:  # no negative overhead: the slope through the origin
            return (0.0, sum(x * y for x, y in samples) / sum(x * x for x, _ in samples))
        return (a, b)


@dataclass
class LoadDecision:
    chunks: int  # leading chunks to load (0: compute them all)
    predicted_seconds: float | None = None  # of loading them; None: nothing to predict from
    skipped_blocks: int = 0  # blocks of the hit computed instead of loaded


class LoadPredictor:
    def __init__(
        self, block_size: int, enabled: bool = True, block_bytes: int = 0, prior_bytes_per_s: float = 1e9
    ) -> None:
        """`block_bytes`: a KV block's bytes in the store (0: unknown, so an unmeasured path is
        probed); `prior_bytes_per_s`: the bandwidth assumed until loads are measured."""
        self.block_size = block_size
        self.enabled = enabled
        self.block_bytes = block_bytes
        self.prior_bytes_per_s = prior_bytes_per_s
        self.loads = LinearFit()  # x: blocks loaded, y: seconds
        self.prefill = LinearFit(flat_without_slope=True)  # x: prompt tokens computed, y: seconds
        self.bytes_per_block = 0.0
        self._skips_in_a_row = 0
        self._probe_next = False  # a lookup went ahead as a probe: load a chunk of what it finds
        self.lookup_s = 0.0  # a store lookup's wait (moving average): paid before any load

    # ----- measurements -----
    def observe_load(self, blocks: int, nbytes: int, seconds: float) -> None:
        if blocks > 0:
            self.loads.add(blocks, seconds)
            self.bytes_per_block = nbytes / blocks

    def observe_lookup(self, seconds: float) -> None:
        self.lookup_s = seconds if not self.lookup_s else 0.8 * self.lookup_s + 0.2 * seconds

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS:
            self.prefill.add(tokens, seconds)

    def load_seconds(self, blocks: int) -> float | None:
        fit = self.loads.coefficients()
        return None if fit is None else fit[0] + fit[1] * blocks

    def _load_or_prior(self, blocks: int) -> float:
        fit = self.load_seconds(blocks)
        return fit if fit is not None else blocks * self.block_bytes / self.prior_bytes_per_s

    def compute_seconds(self, tokens: int) -> float | None:
        """The prefill time `tokens` more prompt tokens add to a step (its marginal cost)."""
        fit = self.prefill.coefficients()
        return None if fit is None else fit[1] * tokens

    @property
    def bytes_per_second(self) -> float:
        fit = self.loads.coefficients()
        return self.bytes_per_block / fit[1] if fit is not None and fit[1] > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        fit = self.prefill.coefficients()
        return 1.0 / fit[1] if fit is not None and fit[1] > 0 else 0.0

    def prefill_seconds(self, tokens: int) -> float | None:
        """A step's predicted time to compute `tokens` prompt tokens (its fixed part included)."""
        fit = self.prefill.coefficients()
        return None if fit is None else fit[0] + fit[1] * tokens

    def _probe_is_cheap(self, chunk_blocks: int, filled: int, compute_tokens: int, lookup_s: float) -> bool:
        """Whether loading one chunk (`filled` of its blocks new) would cost the request whose
        prefill is `compute_tokens` prompt tokens at most PROBE_LOSS of that prefill."""
        saved = self.compute_seconds(filled * self.block_size)
        prefill = self.prefill_seconds(compute_tokens)
        if saved is None or prefill is None:
            return True
        loss = self._load_or_prior(chunk_blocks) + lookup_s - saved
        return loss <= PROBE_LOSS * prefill

    def _probe_due(self) -> bool:
        """One more skip; whether a probe is due (it stays due until one is taken)."""
        self._skips_in_a_row += 1
        return self._skips_in_a_row >= PROBE_EVERY

    # ----- the decision -----
    def decide(self, chunk_blocks: int, wanted: list[int], compute_tokens: int | None = None) -> LoadDecision:
        """How many leading chunks of a store hit to load. `wanted[i]`: the blocks chunk i fills
        (its first may hold fewer: blocks the GPU or host tier already has); `compute_tokens`:
        the prompt tokens the request computes if nothing is loaded (None: the hit's), the
        measure of what a probe may cost it."""
        n = len(wanted)
        total = sum(wanted)
        if compute_tokens is None:
            compute_tokens = total * self.block_size
        if not n:
            self._probe_next = False  # a probe's lookup found nothing: the next due one waits
            return LoadDecision(0)
        if not self.enabled:
            return LoadDecision(n, self.load_seconds(n * chunk_blocks))
        if self.compute_seconds(1) is None:  # no prefill measured: nothing to weigh it against
            return LoadDecision(n, self.load_seconds(n * chunk_blocks))
        measured = self.loads.measured
        if not measured and not self.block_bytes:  # nothing to predict from: one chunk (a probe)
            return LoadDecision(1, None, total - wanted[0])
        best, best_gain, filled = 0, 0.0, 0
        for k in range(1, n + 1):
            filled += wanted[k - 1]
            load = self._load_or_prior(k * chunk_blocks)
            saved = self.compute_seconds(filled * self.block_size)
            assert saved is not None
            if saved - load > best_gain:
                best, best_gain = k, saved - load
        if not measured:  # as the prior says, or a probe where it says no
            k = best or 1
            return LoadDecision(k, self._load_or_prior(k * chunk_blocks), total - sum(wanted[:k]))
        if best == 0 and n * chunk_blocks > EXTRAPOLATE * self.loads.max_x:
            best = min(n, -(-2 * int(self.loads.max_x) // chunk_blocks))  # a larger probe: see above
        elif best == 0:
            due = self._probe_due() and self._probe_is_cheap(chunk_blocks, wanted[0], compute_tokens, 0.0)
            if self._probe_next or due:
                best = 1  # measure the path again: it may have got faster
                self._skips_in_a_row = 0
        else:
            self._skips_in_a_row = 0
        self._probe_next = False
        if best == 0:
            return LoadDecision(0, None, total)
        return LoadDecision(best, self.load_seconds(best * chunk_blocks), total - sum(wanted[:best]))

    def worth_looking(self, chunk_blocks: int, max_chunks: int, compute_tokens: int | None = None) -> bool:
        """Whether a store hit of up to `max_chunks` chunks could be worth looking up and loading
        at all, the lookup's own wait counted (False: skip the lookup; once a probe is due, the
        first request it costs little, `compute_tokens` prompt tokens to compute, looks anyway and
        loads a chunk)."""
        if not self.enabled or max_chunks < 1 or not self.loads.measured or self.compute_seconds(1) is None:
            return True
        if max_chunks * chunk_blocks > EXTRAPOLATE * self.loads.max_x:
            return True  # decide() probes a larger load
        for k in (1, max_chunks):  # the gain is linear in k: the best is at an end
            load = self.load_seconds(k * chunk_blocks)
            saved = self.compute_seconds(k * chunk_blocks * self.block_size)
            if load is not None and saved is not None and saved > load + self.lookup_s:
                return True
        if compute_tokens is None:
            compute_tokens = max_chunks * chunk_blocks * self.block_size
        if self._probe_due() and self._probe_is_cheap(
            chunk_blocks, chunk_blocks, compute_tokens, self.lookup_s
        ):
            self._probe_next = True
            return True
        return False


def error_bucket(error_s: float) -> int:
    """The histogram bucket of an absolute prediction error (len(ERROR_BOUNDS) = +Inf)."""
    for i, bound in enumerate(ERROR_BOUNDS):
        if error_s <= bound:
            return i
    return len(ERROR_BOUNDS)
