"""Keep freed host memory in the process, the way a GPU's caching allocator keeps device memory.

PyTorch's CUDA tensors come from a caching allocator: a step's activations, freed at the end of
backward, are handed straight back to the next step's forward. Its CPU tensors have no cache of
their own; they come from the C library's `malloc`, and glibc's defaults return large freed
blocks to the kernel (a block over the mmap threshold is `munmap`ed when freed; the top of the
heap is trimmed once more than the trim threshold lies free there). The next step then asks the
kernel for that memory again, and every 4 KiB page of it costs a page fault and a zero-fill on
first touch, inside the forward or backward that touches it.

How much depends on the allocator's history, not on the strategy. glibc moves both thresholds
by itself (a freed mmapped block raises the mmap threshold to its size), so two processes
running the same model can differ by thousands of faults a step: two models trained in turns in
one process, one whose gradients are views into flat buckets and one whose gradients are freed
each step, fault differently in their forwards, and the one that faults more is slower in CPU
time for it. That is the allocator, and on CPU it is counted as compute (the thread's CPU time,
which the virtual clock replays, includes the kernel's fault handling).

`keep_freed_memory()` fixes both thresholds with `mallopt`: blocks up to glibc's largest mmap
threshold (32 MiB on 64-bit Linux) come from the heap, and the heap is never trimmed, so after
the first step a run's allocations reuse the pages it already has, as on a GPU. The cost is that
the process keeps its peak footprint until it exits; peak memory itself is unchanged. Blocks
over 32 MiB are still mapped and unmapped one by one (glibc caps the threshold there).

`train.host_allocator` chooses: `keep` (the default) or `system` (glibc's defaults, as a plain
`python` process has them). It is set once, at the start of every rank, for ours and PyTorch's
strategies alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

HOST_ALLOCATORS = ("keep", "system")

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's cap on the mmap threshold on 64-bit: DEFAULT_MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * sizeof(long).
MMAP_THRESHOLD_MAX = 32 << 20
# Never trim the heap: the largest value mallopt takes (an int; glibc stores it as a size_t).
NEVER_TRIM = 2**31 - 1


@functools.cache
def _glibc():
    """The C library, if it is glibc (mallopt with these parameters is glibc's); None otherwise."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):  # musl and others have no gnu_get_libc_version
        return None
    return libc


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks up to 32 MiB in the process; True if it took effect.

    False where the C library is not glibc (macOS, musl): there the system allocator's own
    behaviour stands, and the run's log says so.
    """
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success, 0 on error. The mmap threshold first: setting either one
    # also switches off glibc's own moving of both.
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def apply_host_allocator(choice: str) -> str:
    """Set this process's host allocator as `train.host_allocator` says; returns what it now is,
    in words, for the run's log."""
    if choice == "system":
        return "system (glibc's defaults)"
    if choice != "keep":
        raise ValueError(f"train.host_allocator={choice!r}: choose one of {', '.join(HOST_ALLOCATORS)}")
    if keep_freed_memory():
        return "keep (glibc keeps freed blocks up to 32 MiB: mmap threshold 32 MiB, no trim)"
    return "system (train.host_allocator=keep has no effect here: the C library is not glibc)"
