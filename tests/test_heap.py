"""Freed host memory stays in the process (glibc's malloc thresholds)."""

import json
import os
import subprocess
import sys

import pytest

from draftline.core.heap import HEAP_REUSE_ENV, MMAP_THRESHOLD, TRIM_THRESHOLD

# glibc's own accounting: bytes in mapped blocks, and free bytes kept in the heap
_HEAP_AFTER_BIG_BLOCKS = """
import ctypes, json, sys
import torch
from draftline.core.heap import reuse_freed_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = reuse_freed_heap() if sys.argv[1] == "reuse" else None
blocks = [torch.ones(4 << 20) for _ in range(8)]  # 8 x 16 MiB, as a pass's states
mapped = libc.mallinfo2().hblkhd
del blocks
print(json.dumps({"applied": applied, "mapped": mapped, "kept": libc.mallinfo2().fordblks}))
"""


def heap_after_big_blocks(mode: str, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", _HEAP_AFTER_BIG_BLOCKS, mode],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0 and "mallinfo2" in proc.stderr:
        pytest.skip("not glibc 2.33+ (no mallinfo2 to read the heap with)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_big_blocks_come_from_the_heap_and_stay_there_once_freed():
    default, reused = heap_after_big_blocks("default"), heap_after_big_blocks("reuse")
    assert default["mapped"] >= 8 * (16 << 20)  # glibc's defaults: each block mapped anew
    assert reused["applied"] is True
    assert reused["mapped"] < 16 << 20
    assert reused["kept"] >= 8 * (16 << 20)  # freed, and still the process's to reuse


def test_a_process_started_with_the_variables_keeps_its_memory_too():
    """Tensor-parallel workers and servers are fresh processes: glibc reads the variables."""
    assert HEAP_REUSE_ENV == {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
                              "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
    started = heap_after_big_blocks("default", HEAP_REUSE_ENV)
    assert started["mapped"] < 16 << 20
    assert started["kept"] >= 8 * (16 << 20)
