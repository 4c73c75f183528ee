"""Our worker processes use few malloc arenas, so what their threads free is used again,
and keep the blocks of a few MiB they free for the next element (`reuse_freed_blocks`).

glibc gives each thread that meets contention its own arena (up to 8 per core), and an
arena keeps the memory freed in it for later. A worker's threads (read-ahead, decoding)
each touch tens of MiB per element at times, so every arena kept its own high point:
in the 10-minute soak with 2 workers each worker's own pages (RssAnon) grew 23-28 MiB
between the halves, to 463-517 MiB. With `WORKER_ARENAS` arenas they held 272-298 MiB,
with the same rows. A host's process is not ours to configure; a worker is, and it sets
the limit as it starts, before its threads. A no-op where the C library is not glibc.

The main process is the host's: it keeps glibc's settings but one (below). When it
decodes elements itself while workers run (stragglers: a worker held up by a long
element), its threads touch memory that their arenas keep once freed. With workers it
hands the freed pages of every arena back to the kernel at most every `TRIM_INTERVAL_S`
(`release_freed`, glibc's `malloc_trim`, 3-4 ms a call in the soak): what is in use is
untouched.

That is not enough alone: `malloc_trim` gives back the free pages inside an arena and
the top of the main arena, but not the top of a thread arena (its free end), which glibc
shrinks only when a free leaves it over `M_TRIM_THRESHOLD`. And glibc raises that
threshold by itself, to twice the size of the largest `mmap`ped block freed so far (with
`M_MMAP_THRESHOLD`, up to 32 MiB and 64 MiB): after the first freed image-sized array
(in the soak within the first 26 s), each thread arena keeps the high point of its
image-sized blocks (files read, decoded pixels) for good, 10-34 MiB each, 15 arenas.
So, with workers only, the main process fixes that threshold at `MAIN_TRIM_THRESHOLD`
(`keep_thread_tops_trimmed`, once): this is a setting of the host's allocator, the one
this module changes there, and it has a cost: a thread that frees a block at its arena's
top and allocates it again faults its pages in again (a 4-12 MiB buffer freed and taken
again in a loop: 1.4-18 ms instead of 0.2-1.5 ms; docs/performance.md, the soak). It
also stops glibc moving its `mmap` threshold, which stays where it was then.
"""

from __future__ import annotations

import ctypes

WORKER_ARENAS = 2
# A worker's blocks up to this size come from its arenas, and an arena's free top goes back
# to the kernel only beyond `WORKER_TRIM_BYTES` (see `reuse_freed_blocks`).
WORKER_MMAP_BYTES = 32 << 20
WORKER_TRIM_BYTES = 128 << 20
TRIM_INTERVAL_S = 5.0  # the main process's freed heap pages go back at most this often
# The most free memory a thread arena keeps at its top in the main process with workers
# (glibc's initial M_TRIM_THRESHOLD is 128 KiB; it moves with the mmap threshold).
MAIN_TRIM_THRESHOLD: int | None = 1 << 20
_M_ARENA_MAX = -8  # mallopt's parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_TRIM_THRESHOLD = -1


def _glibc():
  try:
    libc = ctypes.CDLL(None)
    libc.mallopt  # pylint: disable=pointless-statement
    return libc
  except (OSError, AttributeError):
    return None  # another C library (musl, macOS): nothing to do


_LIBC = _glibc()


def _mallopt(*settings: tuple[int, int]) -> bool:
  """Sets glibc's malloc parameters, in order; True when every one was set."""
  return _LIBC is not None and all(_LIBC.mallopt(param, value) for param, value in settings)


def limit_arenas(count: int = WORKER_ARENAS) -> bool:
  """At most `count` malloc arenas in this process from now on (a worker's first step)."""
  return _mallopt((_M_ARENA_MAX, count))


def reuse_freed_blocks(mmap_bytes: int = WORKER_MMAP_BYTES,
                       trim_bytes: int = WORKER_TRIM_BYTES) -> bool:
  """A worker's freed blocks of a few MiB are used again rather than given back (its
  second step).

  glibc by default maps a large block on its own and unmaps it when freed, or, once its
  moving threshold has risen, gives an arena's free top back as soon as it exceeds twice
  that threshold: a thread that allocates and frees an element's images and arrays (2-30
  MiB) touches fresh pages for every element, one page fault per 4 KiB. In a worker that
  was 2,000-2,700 faults per packed row on the bench data, several ms of system CPU per
  row. Fixed thresholds (which also stop them moving) keep those pages for the next element:
  about half the faults and 2-4 ms of system CPU per row less; the workers' peak RSS within
  15 MiB of before (the pages were touched at the peak anyway). See docs/performance.md."""
  return _mallopt((_M_MMAP_THRESHOLD, mmap_bytes), (_M_TRIM_THRESHOLD, trim_bytes))


def release_freed() -> bool:
  """Gives the kernel back the whole pages that glibc's arenas keep freed (`malloc_trim(0)`:
  every arena, not only the top of the main heap); True when some were released."""
  return bool(_LIBC is not None and hasattr(_LIBC, "malloc_trim") and _LIBC.malloc_trim(0))


def keep_thread_tops_trimmed(threshold: int | None = None) -> bool:
  """From now on every arena's free top beyond `threshold` bytes (default
  `MAIN_TRIM_THRESHOLD`; when that is None, nothing is changed) goes back to the kernel
  when a block next to it is freed (`mallopt(M_TRIM_THRESHOLD)`; glibc no longer moves
  that threshold, nor its mmap threshold, by itself). True when set."""
  threshold = MAIN_TRIM_THRESHOLD if threshold is None else threshold
  return threshold is not None and _mallopt((_M_TRIM_THRESHOLD, threshold))
