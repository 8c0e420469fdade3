"""glibc malloc settings for the ``bridge-pl`` process: keep freed memory for reuse instead of mapping it afresh.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and unmaps it on free,
so each such tensor pays one page fault per 4 KiB page touched, every time it is allocated again. A rollout or
update of the demo's policy allocates tensors of that size in every layer (48 rows x 169 tokens x 1536 float32 is
50 MB), so on CPU the kernel time of those ops is mostly page faults. With mmap off and a high trim threshold, freed
blocks stay in the heap and are reused (``benchmarks/allocator_bench.py`` measures both).

The settings change only where memory comes from, not any result. They are skipped when the user set glibc's
malloc variables (``MALLOC_*_`` or a ``glibc.malloc`` tunable) or ``BRIDGE_PL_MALLOC=system``, and on a C library
without ``mallopt``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

ENV = "BRIDGE_PL_MALLOC"  # "reuse" (default) or "system" (leave glibc as it is)
CHOICES = ("reuse", "system")
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # bytes free at the heap's top before it is given back: mallopt's int maximum (2 GiB)


def user_malloc_settings(environ: Mapping[str, str]) -> list[str]:
    """The environment variables through which the user already configured glibc malloc."""
    names = [name for name in environ if name.startswith("MALLOC_") and name.endswith("_")]
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        names.append("GLIBC_TUNABLES")
    return sorted(names)


def reuse_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Turn glibc's mmap for large blocks off and raise its trim threshold, unless the user chose otherwise.

    Returns whether the settings were applied. Raises ``ValueError`` for an unknown ``BRIDGE_PL_MALLOC`` value.
    """
    environ = os.environ if environ is None else environ
    choice = environ.get(ENV, "reuse")
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "system" or user_malloc_settings(environ):
        return False
    mallopt = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
