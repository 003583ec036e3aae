"""Host memory that is not glibc's: the kernel caches of oneDNN (bf16 products on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grpo.runtime.host_memory import KERNEL_CACHES

# 600 bf16 products of as many shapes, as scoring sees new packed lengths step after step; the
# heap's growth over them, in MiB (glibc's mallinfo2: in-use bytes)
NEW_SHAPES = """
import ctypes
import torch
from grpo.build import prepare_process
from grpo.config import Config

prepare_process(Config())  # caps the caches, unless the environment set them

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
w = torch.randn(256, 64).bfloat16()
torch.randn(1, 256).bfloat16() @ w
before = libc.mallinfo2().uordblks
for m in range(2, 602):
    torch.randn(m, 256).bfloat16() @ w
print((libc.mallinfo2().uordblks - before) / 2**20)
"""


def heap_growth_mib(*envs: dict[str, str]) -> list[float]:
    """The growth under each environment, the processes side by side (a fresh one each: the
    caches read their capacity once, at their first use)."""
    clean = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHES}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", NEW_SHAPES],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**clean, **env},
        )
        for env in envs
    ]
    outs = [proc.communicate() for proc in procs]
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-2000:]
    return [float(out) for out, _ in outs]


def test_importing_grpo_leaves_the_environment_alone() -> None:
    code = "import os; e = dict(os.environ); import grpo, grpo.cli; print(sorted(k for k in os.environ if k in KERNEL_CACHES and k not in e))"
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHES}
    out = subprocess.run(
        [sys.executable, "-c", f"KERNEL_CACHES = {KERNEL_CACHES!r}; {code}"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert out.stdout.strip() == "[]"


def test_a_run_caps_the_kernel_caches_and_leaves_a_set_capacity_alone() -> None:
    libraries_default, capped = heap_growth_mib(
        {"LRU_CACHE_CAPACITY": "1024", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}, {}
    )
    if libraries_default < 100:
        pytest.skip(f"bf16 products here keep no per-shape kernels ({libraries_default:.0f} MiB)")
    # at the libraries' 1024 entries each, about half a MiB a shape stays (319 MiB measured
    # here); at grpo's 64 what stays is bounded by the 64 most recent shapes
    assert capped < libraries_default / 4, (capped, libraries_default)


def test_a_child_gets_the_environment_as_found_and_unbounding_restores_it(monkeypatch) -> None:
    from grpo.runtime import host_memory as memory

    monkeypatch.setattr(memory, "_SET_HERE", set())
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")  # the user's: kept
    memory.bound_kernel_caches(32)
    assert os.environ["LRU_CACHE_CAPACITY"] == "32"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
    child = memory.environment_as_found()
    assert "LRU_CACHE_CAPACITY" not in child
    assert child["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
    memory.unbound_kernel_caches()
    assert "LRU_CACHE_CAPACITY" not in os.environ
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
