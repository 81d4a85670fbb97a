"""Triton kernels of the GPU path; each has a plain-PyTorch twin in `kernels.reference`.

Every kernel is wrapped by `dual_jit` (defined here, before the submodules import it)
rather than bare `triton.jit`: the wrapper compiles for the GPU when the tensors live on
CUDA and runs Triton's interpreter when they live on the CPU (or when TRITON_INTERPRET=1
is set at launch time). So the choice is made per launch, not when the module is imported:
CPU tests need no environment dance, import order cannot leave a kernel in the wrong mode,
and CPU and CUDA runs can share one process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch


class DualKernel:
    """A Triton kernel launchable as `kernel[grid](*args, **kwargs)` on CUDA or CPU tensors.

    Device functions called from a kernel must be plain Python inlined into it: a nested
    `@triton.jit` helper cannot serve both the compiler and the interpreter, so our kernels
    keep everything in one body.
    """

    def __init__(self, fn: Callable[..., Any], pdl: bool = False, **jit_kwargs: Any) -> None:
        self.fn = fn
        # pdl: the kernel takes a `PDL: tl.constexpr` and, when it is set, waits on the grid
        # before it in the stream (`gdc_wait`) before it touches anything that grid may write.
        self.pdl = pdl
        self._jit_kwargs = jit_kwargs
        self._compiled: Any = None
        self._interpreted: Any = None
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    @property
    def compiled(self) -> Any:
        if self._compiled is None:
            from triton.runtime.jit import JITFunction

            self._compiled = JITFunction(self.fn, **self._jit_kwargs)
        return self._compiled

    @property
    def interpreted(self) -> Any:
        if self._interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction

            self._interpreted = InterpretedFunction(self.fn, **self._jit_kwargs)
        return self._interpreted

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        """`kernel[grid](*args)`, as with `triton.jit`; the first tensor argument picks the mode."""

        def launch(*args: Any, **kwargs: Any) -> Any:
            device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            if not is_interpreted(device):
                if self.pdl:
                    kwargs["PDL"] = on = pdl_enabled(device)
                    if on:
                        kwargs["launch_pdl"] = True
                return self.compiled[grid](*args, **kwargs)
            if self.pdl:
                kwargs["PDL"] = False
            with _interpretable_lang():
                return self.interpreted[grid](*args, **kwargs)

        return launch


def _lang_namespaces() -> list[Any]:
    """The modules and classes Triton's interpreter monkey-patches while it runs a kernel."""
    import triton.language as tl

    candidates = [
        tl,
        tl.core,
        tl.math,
        getattr(tl, "standard", None),
        getattr(tl, "random", None),
        tl.core.tensor,
        tl.core.dtype,
        getattr(tl, "condition", None),
        getattr(tl.core, "tensor_descriptor_base", None),
    ]
    return [c for c in candidates if c is not None]


@contextlib.contextmanager
def _interpretable_lang() -> Iterator[None]:
    """Run a CPU launch under the interpreter without disturbing compiled launches.

    * triton.language's own jit'd helpers (tl.sum, tl.max, tl.zeros, tl.cdiv, ...) are
      compiled or interpreted as decided at triton's import (TRITON_INTERPRET), and whoever
      imported triton first may not have set it: swap in interpreted twins for the launch.
    * The interpreter patches triton.language for a launch and restores it afterwards, but
      not what it patches for nested device-function calls (such as those helpers): a later
      compiled launch in the same process would then fail. So snapshot the namespaces it
      touches and put every patched attribute back on exit.
    * Triton < 3.7 turns a scalar (a 1-element, 1-D array) into an int with int(array), which
      NumPy >= 2.5 rejects, so `range(lo, hi)` over run-time bounds fails: re-patch
      `__index__` right after the interpreter's own patching.
    * The interpreter's cast to e4m3 (float8e4nv) rounds half up and drops a carry out of the
      mantissa (127.4 became 64); the GPU's (`cvt.rn.satfinite`) rounds to nearest even, as
      torch does. Casts to e4m3 go through torch for the launch, so a kernel writes the codes
      under the interpreter that it writes on the GPU, with no rounding by hand in its body.

    Not thread-safe against a concurrent compiled launch in the same process.
    """
    import triton.language as tl
    import triton.runtime.interpreter as interpreter
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    snapshot = [(ns, dict(vars(ns))) for ns in _lang_namespaces()]
    # tl.random's helpers call each other (rand -> randint -> philox) through that module.
    for ns in (tl, getattr(tl, "random", None)):
        for name in dir(ns) if ns is not None else []:
            member = getattr(ns, name)
            if isinstance(member, JITFunction):
                setattr(ns, name, InterpretedFunction(member.fn))

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)

    def patch_tensor_with_index(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if patch_tensor is not None:
        interpreter._patch_lang_tensor = patch_tensor_with_index
    builder = interpreter.InterpreterBuilder
    fp_to_fp = builder.create_fp_to_fp
    builder.create_fp_to_fp = _torch_e4m3_cast(fp_to_fp)
    try:
        yield
    finally:
        builder.create_fp_to_fp = fp_to_fp
        if patch_tensor is not None:
            interpreter._patch_lang_tensor = patch_tensor
        for ns, before in snapshot:
            now = vars(ns)
            # Names new to a module stay: the interpreter injects its own globals into the
            # modules whose functions it rewrites (and caches those rewrites), and submodule
            # imports land there too. Names new to a class are patches: remove them.
            if isinstance(ns, type):
                for name in [n for n in now if n not in before]:
                    delattr(ns, name)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(ns, name, value)


_MISSING = object()


def _torch_e4m3_cast(fp_to_fp: Callable[..., Any]) -> Callable[..., Any]:
    """The interpreter's `create_fp_to_fp`, with fp32 / fp16 -> float8e4nv cast by torch."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in (tl.float32, tl.float16):
            return fp_to_fp(self, src, dst_type, rounding_mode)
        values = torch.from_numpy(np.array(src.data, dtype=np.float32))
        codes = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return TensorHandle(codes.reshape(np.shape(src.data)), dst_type.scalar)

    return create_fp_to_fp


def dual_jit(
    fn: Callable[..., Any] | None = None, **jit_kwargs: Any
) -> DualKernel | Callable[[Callable[..., Any]], DualKernel]:
    """Decorator used instead of `triton.jit` for every kernel of this package: `@dual_jit`, or
    `@dual_jit(do_not_specialize=[...])` with `triton.jit`'s keyword arguments."""
    if fn is None:
        return lambda f: DualKernel(f, **jit_kwargs)
    return DualKernel(fn, **jit_kwargs)


def is_interpreted(device: torch.device) -> bool:
    """True when a launch on `device` runs under Triton's CPU interpreter."""
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"


# Programmatic dependent launch (Hopper and later): a kernel launched with it may be scheduled
# while the kernel before it in the stream is still running; it waits for that kernel's results
# (`gdc_wait`, griddepcontrol.wait) only where it needs them. At batch 1 a decode step is ~290
# kernels of a few microseconds each, and each boundary costs a launch, a pipeline fill and the
# last wave's tail in series; with PDL the next kernel's programs are resident and its weights on
# their way into L2 when the previous one ends (what TensorRT-LLM's and FlashInfer's decode
# kernels do). Every `dual_jit(pdl=True)` kernel calls `gdc_wait` before its first read of
# anything another kernel writes and before any write of its own, then `gdc_launch_dependents`,
# so the kernel after it can start early but never more than one kernel ahead. LLMESH_PDL=0
# turns it off (the same kernels launched plainly; `gdc_wait` is then a no-op).
_PDL_BY_DEVICE: dict[int, bool] = {}


def pdl_enabled(device: torch.device) -> bool:
    """True where launches on `device` use programmatic dependent launch (CUDA, sm90+)."""
    if device.type != "cuda" or os.environ.get("LLMESH_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    on = _PDL_BY_DEVICE.get(index)
    if on is None:
        from kernels.triton.pdl import AVAILABLE

        on = _PDL_BY_DEVICE[index] = AVAILABLE and torch.cuda.get_device_capability(index) >= (9, 0)
    return on


# The submodules import `dual_jit` from this (partly initialised) package, hence the late imports.
from kernels.triton.kv_write import write_kv_cache  # noqa: E402
from kernels.triton.paged_attention import merge_attn_partials, paged_attention  # noqa: E402
from kernels.triton.rms_norm import rms_norm, rms_norm_fp8  # noqa: E402
from kernels.triton.rotary_kv_write import rotary_and_write_kv  # noqa: E402
from kernels.triton.silu_mul import silu_and_mul, silu_and_mul_fp8  # noqa: E402
from kernels.triton.skinny_gemm import skinny_gemm  # noqa: E402

__all__ = [
    "DualKernel",
    "dual_jit",
    "is_interpreted",
    "pdl_enabled",
    "merge_attn_partials",
    "paged_attention",
    "rms_norm",
    "rms_norm_fp8",
    "rotary_and_write_kv",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "skinny_gemm",
    "write_kv_cache",
]
