"""Host memory: how glibc's malloc treats the tensor memory a step frees.

glibc hands large freed blocks back to the operating system: blocks above its mmap threshold
are unmapped, and free memory at the top of the heap above its trim threshold is released.
Training frees and reallocates the same activation-, gradient- and logits-sized blocks every
micro-batch, so each comes back as fresh pages that the kernel must fault in and zero. Three
policies (measured on SmolLM2-135M in README, Performance):

- ``keep`` (default): blocks under 16 MiB (activations, gradients, attention and logits
  chunks) stay in the heap and are reused; larger ones (a micro-batch's full logits, the
  embedding gradient) are still unmapped, so the heap does not grow around them as their sizes
  change from step to step. Whole steps: 0.83x the time of ``return``, 1.11x its peak RSS.
- ``return``: a 128 KiB mmap threshold, so every freed tensor leaves the process at once and
  comes back as fresh pages (about 5 million page faults, 20 GB, per SmolLM2 update in a
  profile). Lowest peak RSS, slowest steps.
- ``default``: glibc's own adaptive thresholds, untouched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Literal

MallocPolicy = Literal["keep", "return", "default"]

# mallopt parameter numbers in glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

POLICIES: dict[str, dict[int, int]] = {
    "keep": {M_MMAP_THRESHOLD: 16 << 20, M_TRIM_THRESHOLD: (1 << 31) - 1},
    "return": {M_MMAP_THRESHOLD: 1 << 17},
    "default": {},
}


def set_malloc_policy(policy: MallocPolicy) -> bool:
    """Apply ``policy`` to this process; False where libc is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return all(bool(mallopt(param, value)) for param, value in POLICIES[policy].items())
