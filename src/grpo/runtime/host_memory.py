"""Host memory: how glibc's malloc treats the tensor memory a step frees.

glibc hands large freed blocks back to the operating system: blocks above its mmap threshold
are unmapped, and free memory at the top of the heap above its trim threshold is released.
Training frees and reallocates the same activation-, gradient- and logits-sized blocks every
micro-batch, so each comes back as fresh pages that the kernel must fault in and zero. Three
policies (measured on SmolLM2-135M: docs/results/memory-options.md):

- ``keep`` (default): blocks under 16 MiB (activations, gradients, attention and logits
  chunks) stay in the heap and are reused; larger ones (a micro-batch's full logits, the
  embedding gradient) are still unmapped, so the heap does not grow around them as their sizes
  change from step to step. Whole steps: 0.83x the time of ``return``, 1.11x its peak RSS.
- ``return``: a 128 KiB mmap threshold, so every freed tensor leaves the process at once and
  comes back as fresh pages (about 5 million page faults, 20 GB, per SmolLM2 update in a
  profile). Lowest peak RSS, slowest steps.
- ``default``: glibc's own adaptive thresholds, untouched.

A second hold on host memory is not glibc's: oneDNN, which runs bf16 matrix products on the
CPU, and ideep around it each cache up to 1024 compiled kernels, one per shape seen, with their
buffers. Scoring sees new shapes nearly every step (a packed micro-batch's length is that of
its completions), so both caches fill and hold hundreds of MiB. ``bound_kernel_caches`` caps
them when a run starts (``grpo.build.prepare_process``); importing grpo changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
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


# what oneDNN's primitive cache and ideep's computation cache read, each at its first use; 64
# holds every shape of one micro-batch's forward and backward (docs/results/memory-options.md)
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
KERNEL_CACHE_CAPACITY = 64


_SET_HERE: set[str] = set()  # the variables bound_kernel_caches set in this process


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Cap both kernel caches at ``capacity`` entries where the environment does not already
    set them. They read it once, at their first use: before any bf16 product in the process."""
    for name in KERNEL_CACHES:
        if name not in os.environ:
            os.environ[name] = str(capacity)
            _SET_HERE.add(name)


def unbound_kernel_caches() -> None:
    """Undo ``bound_kernel_caches`` in this process, before its first bf16 product: the
    libraries' own defaults, as a program without grpo runs them (TRL's side in benchmarks)."""
    for name in _SET_HERE:
        os.environ.pop(name, None)
    _SET_HERE.clear()


def environment_as_found() -> dict[str, str]:
    """This process's environment without what ``bound_kernel_caches`` set in it: for a child
    process, which then decides for itself (a run it starts caps them again)."""
    return {k: v for k, v in os.environ.items() if k not in _SET_HERE}
