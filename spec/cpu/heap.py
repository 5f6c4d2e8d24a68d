"""Freed heap memory given back to the system, where the C library is glibc; elsewhere nothing happens.

glibc's malloc serves an allocation from its heap, not a mapping of its own, once its dynamic mmap threshold
has risen past the allocation's size, which it does when a mapped block as large is freed (a short run's
logits, a prefill's activations). A long prefill's activations then come from the heap, and freed ones it
cannot reuse in the next layer stay resident: after a short run, SmolLM2's 2,000-token prefill with the
Q4_1 self-draft peaked at 1,259 MB in some processes and 1,515-1,611 MB in others. spec changes no setting
of the process's allocator (mallopt would change it for every caller); it gives the free memory back where
the heap keeps growing during a pass (`release`): a trim costs a re-fault of what the next layer takes
again, so not after every layer (trimming after each layer of that prefill took 23% longer), only where
the allocator is not reusing the room it has."""

from __future__ import annotations

import ctypes

_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.malloc_trim.argtypes = (ctypes.c_size_t,)
        except (OSError, AttributeError):         # (not glibc)
            libc = None
        if libc is not None and hasattr(libc, "mallinfo2"):      # (glibc 2.33 and later)
            class Info(ctypes.Structure):
                _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                            "fsmblks", "uordblks", "fordblks", "keepcost")]
            libc.mallinfo2.restype = Info
        _LIBC.append(libc)
    return _LIBC[0]


def size() -> int:
    """Bytes of the heap's arenas (glibc's mallinfo2 arena: what it took from the system, in use or free); 0
    elsewhere, or on a glibc older than 2.33 (no mallinfo2: `release` then never trims, `trim` still does)."""
    libc = _libc()
    return int(libc.mallinfo2().arena) if libc is not None and hasattr(libc, "mallinfo2") else 0


def trim() -> None:
    """Give the heap's free memory back to the system (glibc's malloc_trim: free memory only, no setting changed)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def release(mark: int, limit: int) -> int:
    """trim where the heap has grown by more than `limit` bytes past `mark` (a `size()`: blocks the allocator
    could not place in the room it had, so freed room it keeps stays resident beside them); the mark to
    pass next time."""
    now = size()
    if now <= mark + limit:
        return mark
    trim()              # (which shrinks the heap where its top is free: the mark stays where it grew to)
    return now
