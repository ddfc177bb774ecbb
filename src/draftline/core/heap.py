"""Keep freed host memory in the process for reuse (glibc's malloc).

A hidden-state capture holds each engine step's states until the reader takes them, then frees
them all at once. glibc serves such multi-megabyte blocks with fresh ``mmap``s and gives freed
heap tops back to the kernel, so the next pass touches new pages: on the toy target the vllm
backend took 45,000-160,000 minor page faults a pass (a plain prefill: none), and every kernel
that first wrote to those pages ran slower, a tenth of the capture's time.

Fixing both thresholds keeps blocks up to 32 MiB on the heap and up to 1 GiB of freed heap for
reuse. Setting one alone also turns off glibc's adaptive threshold: with the trim threshold
alone, every block above 128 KiB is mapped anew (1.7 M faults a pass, the plain prefill's too).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from the heap
TRIM_THRESHOLD = 1 << 30   # freed heap kept for reuse before any goes back to the kernel

# the same settings for the processes this one starts (glibc reads them at start)
HEAP_REUSE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
                  "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}

_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3


def reuse_freed_heap() -> bool:
    """Apply the thresholds to this process; False where the C library has no ``mallopt``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt here: freed memory goes back to the kernel as usual")
        return False
    # mallopt returns 1 on success
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
