"""What a process holds, by kind: holders count while they live, RSS is this process's."""

import gc
import os

import psutil

from bagel_grain import held_memory
from bagel_grain.sources.readahead import ReadAhead


class Holder:
  def __init__(self, nbytes):
    self.nbytes = nbytes


def test_live_holders_are_summed_by_kind_and_a_dead_one_no_longer_counts():
  gc.collect()  # an earlier test's holders, dead in a cycle, would be collected mid-test
  before = held_memory.snapshot()
  a, b = Holder(1000), Holder(24)
  held_memory.register(a, held_memory.READ_AHEAD, lambda h: h.nbytes)
  held_memory.register(b, held_memory.READ_AHEAD, lambda h: h.nbytes)
  during = held_memory.snapshot()
  assert during[held_memory.READ_AHEAD] - before[held_memory.READ_AHEAD] == 1024
  assert during[held_memory.ROW_GROUP_CACHE] == before[held_memory.ROW_GROUP_CACHE]
  del a
  gc.collect()
  assert held_memory.snapshot()[held_memory.READ_AHEAD] - before[held_memory.READ_AHEAD] == 24
  rss = psutil.Process(os.getpid()).memory_info().rss
  assert 0.5 * rss < during["rss_bytes"] < 2 * rss


def test_a_read_ahead_counts_what_it_holds():
  gc.collect()  # as above
  ahead = ReadAhead(threads=1, max_bytes=1 << 20)
  base = held_memory.snapshot()[held_memory.READ_AHEAD] - ahead.held_bytes()
  try:
    assert ahead.start("k", lambda: (b"x" * 5000, 5000), size=5000)
    assert held_memory.snapshot()[held_memory.READ_AHEAD] - base == 5000
    assert ahead.take("k") is not None
    assert held_memory.snapshot()[held_memory.READ_AHEAD] - base == 0
  finally:
    ahead.close()
