"""Lazy Triton import and a lazily decorated `jit`, shared by the kernel files.

Triton decides when it is imported (its own library functions such as tl.sum) and when a kernel is
decorated whether code runs compiled or under its interpreter (`TRITON_INTERPRET=1`). So that
importing `sparrow.kernels` never fixes that choice (nor pays for importing triton on the CPU path),
triton is imported on the first kernel launch and each kernel is decorated then, once per mode. The
kernel files bind the name `tl` to None at import; the first launch points it at `triton.language`.
A kernel may call the jitted helpers of this module (`round_to`) that it names in `lazy_jit(fn,
helpers=...)`; they are decorated with it, once per mode, and bound in its module under their names.
"""

from __future__ import annotations

import importlib.util
import os
import sys

tl = None  # triton.language, bound when a kernel using `round_to` is first decorated

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

    def __init__(self, fn, helpers=()):
        self.fn, self.helpers = fn, tuple(helpers)
        self._compiled = {}

    def __getitem__(self, grid):
        return self.jit()[grid]

    def jit(self):
        """The `triton.jit` function of this mode (the ahead-of-time compile test takes it too)."""
        mode = interpreting()
        triton, tl = load_triton()
        self.fn.__globals__["tl"] = tl  # the kernel bodies and annotations refer to `tl`
        for helper in self.helpers:
            self.fn.__globals__[helper.__name__] = _jitted_helper(helper, mode)
        kernel = self._compiled.get(mode)
        if kernel is None:
            kernel = self._compiled[mode] = triton.jit(self.fn)
        return kernel


_HELPERS: dict[tuple, object] = {}


def _jitted_helper(fn, mode: bool):
    key = (fn, mode)
    if key not in _HELPERS:
        triton, tl = load_triton()
        fn.__globals__["tl"] = tl
        _HELPERS[key] = triton.jit(fn)
    return _HELPERS[key]


def lazy_jit(fn, helpers=()):
    return LazyJit(fn, helpers)


def round_to(x, dt: tl.constexpr):
    """x (as fp32) rounded to the dtype dt (to nearest, ties to even) and back to fp32, a jitted helper.
    bf16 is rounded by integer arithmetic on the bits: the interpreter's own fp32 -> bf16 cast rounds
    toward zero, compiled kernels' to nearest even, and this gives the latter in both."""
    if dt == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use Backend.TORCH (the CPU path) instead")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
