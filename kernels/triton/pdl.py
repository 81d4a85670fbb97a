"""Grid dependency control for the `dual_jit(pdl=True)` kernels (see `kernels.triton.pdl_enabled`).

`gdc_wait` blocks a program until the grid before it in the stream has finished and its writes
are visible; `gdc_launch_dependents` lets the grid after it be scheduled. Both are no-ops in a
kernel launched without PDL. `L2_PREFETCH_ASM` (inline asm) asks for a line to be brought into L2
and returns at once: a kernel may issue it before `gdc_wait` only for memory no kernel writes
while it runs (weights); it reads nothing into registers, so there is no stale value to use.
"""

from __future__ import annotations

import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # a Triton without grid dependency control: the kernels launch plainly
    gdc_launch_dependents = gdc_wait = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "L2_PREFETCH_ASM", "gdc_launch_dependents", "gdc_wait"]

# One `prefetch.global.L2` per element of a pointer tensor (a dummy 0 as its value, so the
# element-wise inline asm has an output); callers pass one pointer per 128-byte line.
# A constexpr: a kernel may read a module global only if it is one.
L2_PREFETCH_ASM = tl.constexpr("prefetch.global.L2 [$1]; mov.u32 $0, 0;")
