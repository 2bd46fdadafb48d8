"""Lazy Triton import and a lazily decorated `jit`, shared by the kernel files.

Triton decides when it is imported (its own library functions such as tl.sum) and when a kernel is
decorated whether code runs compiled or under its interpreter (`TRITON_INTERPRET=1`). So that
importing `sparrow.kernels` never fixes that choice (nor pays for importing triton on the CPU path),
triton is imported on the first kernel launch and each kernel is decorated then, once per mode. The
kernel files bind the name `tl` to None at import; the first launch points it at `triton.language`.
Kernels must not call other jitted helpers of ours; they are written flat.
"""

from __future__ import annotations

import importlib.util
import os
import sys

HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def load_triton():
    """Import triton (once) and return (triton, triton.language)."""
    require_triton()
    import triton
    import triton.language as tl

    return triton, tl


def interpreter_usable() -> bool:
    """Whether triton, as imported in this process, can run kernels under its interpreter.

    Triton's own library functions (tl.sum, tl.max, ...) are decorated when triton is imported, so
    TRITON_INTERPRET=1 must be set before the first `import triton` of the process."""
    if not HAS_TRITON or not interpreting():
        return False
    if "triton" not in sys.modules:
        return True
    _, tl = load_triton()
    return type(tl.standard.sum).__name__ == "InterpretedFunction"


class LazyJit:
    """`kernel[grid](...)` like a `triton.jit` function, decorated on first use per interpreter mode."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = {}

    def __getitem__(self, grid):
        mode = interpreting()
        kernel = self._compiled.get(mode)
        if kernel is None:
            triton, tl = load_triton()
            self.fn.__globals__["tl"] = tl  # the kernel bodies and annotations refer to `tl`
            kernel = self._compiled[mode] = triton.jit(self.fn)
        return kernel[grid]


def lazy_jit(fn):
    return LazyJit(fn)


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use impl='torch' (the CPU path) instead")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
