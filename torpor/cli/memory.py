"""Process memory figures for the load test and the benchmarks: RSS now, peak RSS, settling.

RSS is what an operator pays for, so it is the headline; but freed Python
objects do not always go back to the OS. :func:`settle` collects garbage and
asks glibc to return free heap pages first, so a reading taken after it
reflects what is still in use, as far as the allocator allows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
import sys

__all__ = ["peak_rss_bytes", "rss_bytes", "settle"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process now (Linux: /proc; elsewhere: the peak)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The highest RSS this process reached (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _malloc_trim() -> None:
    if not sys.platform.startswith("linux"):
        return
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        return


def settle() -> None:
    """Collect cyclic garbage and hand free heap pages back, before reading RSS."""
    gc.collect()
    _malloc_trim()
