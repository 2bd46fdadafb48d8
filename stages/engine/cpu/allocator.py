"""glibc's allocator tuned for a CPU rollout process: large blocks reused from the heap, not mmapped anew.

By default every block above glibc's mmap threshold is a fresh mmap, so a large tensor costs a page fault
per 4 KiB each time it is allocated. Applied once per process on the CPU; process-wide and irreversible
(freed memory stays with the process, which a rollout or training process wants).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def tune_cpu_allocator() -> bool:
    """Raise glibc's mmap threshold to 1 GiB, never trim the heap, grow it 1 GiB at a time; False
    where this does not apply (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(-3, ctypes.c_int(1 << 30))  # M_MMAP_THRESHOLD
        ok &= libc.mallopt(-1, ctypes.c_int(2**31 - 1))  # M_TRIM_THRESHOLD
        ok &= libc.mallopt(-2, ctypes.c_int(1 << 30))  # M_TOP_PAD
        return bool(ok)
    except (OSError, AttributeError):
        return False
