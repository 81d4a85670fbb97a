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

    def __init__(self, fn: Callable[..., Any], **jit_kwargs: Any) -> None:
        self.fn = fn
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
                return self.compiled[grid](*args, **kwargs)
            with _interpretable_lang():
                return self.interpreted[grid](*args, **kwargs)

        return launch


@contextlib.contextmanager
def _interpretable_lang() -> Iterator[None]:
    """Make triton.language's own jit'd helpers (tl.sum, tl.max, tl.zeros, tl.cdiv, ...) callable
    from interpreted code for the duration of a launch.

    Triton decides at its own import whether those helpers are compiled or interpreted
    (TRITON_INTERPRET), and whoever imported triton first may not have set it. Swapping them
    for interpreted twins around each CPU launch removes that dependence on import order.
    Not thread-safe against a concurrent *compiled* launch in the same process.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    swapped: dict[str, Any] = {}
    for name in dir(tl):
        member = getattr(tl, name)
        if isinstance(member, JITFunction):
            swapped[name] = member
            setattr(tl, name, InterpretedFunction(member.fn))
    try:
        yield
    finally:
        for name, member in swapped.items():
            setattr(tl, name, member)


def dual_jit(fn: Callable[..., Any]) -> DualKernel:
    """Decorator used instead of `triton.jit` for every kernel of this package."""
    return DualKernel(fn)


def is_interpreted(device: torch.device) -> bool:
    """True when a launch on `device` runs under Triton's CPU interpreter."""
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"


# The submodules import `dual_jit` from this (partly initialised) package, hence the late imports.
from kernels.triton.kv_write import write_kv_cache  # noqa: E402
from kernels.triton.paged_attention import merge_attn_partials, paged_attention  # noqa: E402
from kernels.triton.rms_norm import rms_norm  # noqa: E402
from kernels.triton.rotary import rotary_embedding  # noqa: E402

__all__ = [
    "DualKernel",
    "dual_jit",
    "is_interpreted",
    "merge_attn_partials",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "write_kv_cache",
]
