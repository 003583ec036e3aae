"""Host memory: give freed tensor memory back to the operating system.

glibc serves an allocation from its heap unless it is larger than an mmap threshold, and it
raises that threshold (up to 32 MiB) each time a large block is freed. Training frees and
reallocates activation-sized blocks (a few MiB each) every micro-batch, so after the first
step they live in the heap, where freed memory stays counted in the process's resident size.
A fixed threshold keeps them mmapped: a freed activation leaves the process. Measured on
SmolLM2-135M (README, Performance): about 10 % lower peak RSS, no measurable slowdown.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h


def return_freed_memory(threshold_bytes: int = 1 << 17) -> bool:
    """Serve allocations of ``threshold_bytes`` or more with mmap; False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes))
