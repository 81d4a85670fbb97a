"""Rounding the kernels spell out where two kernels must agree bit for bit.

`mul_rn(x, y)` is a product rounded on its own (libdevice's __nv_fmul_rn), never contracted
into an fma with the sum it feeds. The compiler contracts `a * b - c * d` as it sees fit, and
two kernels computing the same rotation (`_rotary_kv_write_kernel`, and `_paged_decode_kernel`
rotating q itself) contracted it differently: 1 ulp apart. GPU only: the interpreter never
contracts, so a kernel takes plain `*` there.
"""

from __future__ import annotations

from triton.language.extra.cuda.libdevice import mul_rn

__all__ = ["mul_rn"]
