"""What the packer's stage iterators share: `with` closes them, and their own time is Grain's.

Each stage records, as Grain's own transformations do, its output spec
(`record_output_spec`) and the time of its own work (`record_self_time`), less the
time it spent waiting on what feeds it (its parent stage, or the fetcher's
decoding). With Grain's stage timing on (`with_stage_timing`), Grain's execution
statistics then show where the main process spends its time, stage by stage
(`StageIterator.stage_seconds`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Callable, TypeVar

import grain

T = TypeVar("T")


class StageIterator(grain.DatasetIterator):
  """A `grain.DatasetIterator` usable as `with iter(ds) as it:`; closing is idempotent."""

  def __init__(self, parents=()):
    super().__init__(parents)
    self._waited_ns = 0

  def __enter__(self):
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def stage_seconds(self) -> dict[str, float]:
    """Seconds of own work so far of this stage and those feeding it, summed by iterator
    class, from Grain's execution statistics (switch them on with `with_stage_timing`).

    Grain 0.2.18 exports no reader of its statistics, and its reporting thread drains
    the recorded times into each node's summary: draining them from this thread too
    would race it. So each node is read as it stands, summary plus times not yet
    drained, and nothing is changed.
    """
    seconds: dict[str, float] = {}
    nodes = [self._stats]
    while nodes:
      node = nodes.pop()
      summary = getattr(node, "_summary", None)
      if summary is not None:  # an execution-statistics node (stage timing is on)
        reported = summary.total_processing_time_ns  # read first: a drain only moves time here
        pending = sum(t.duration_ns for t in list(node._self_times_buffer) if t.num_elements > 0)
        name = node._config.name.split("(")[0]
        seconds[name] = seconds.get(name, 0.0) + (reported + pending) / 1e9
      nodes.extend(node._parents)
    return seconds

  def _waiting(self, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, its time left out of this stage's own time."""
    start = time.perf_counter_ns()
    try:
      return fn(*args)
    finally:
      self._waited_ns += time.perf_counter_ns() - start

  def _own_time(self, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, recorded in Grain's stats as this stage's time less what it waited."""
    stats = self._stats  # made before the stages it waits on make theirs: Grain links them
    start, waited = time.perf_counter_ns(), self._waited_ns
    try:
      return fn(*args)
    finally:
      own = time.perf_counter_ns() - start - (self._waited_ns - waited)
      with stats.record_self_time(offset_ns=own):
        pass


class PositionedStageIterator(StageIterator):
  """A stage whose state is its position (`position`, `state_of`, `parse_state`, `restore`),
  and whose `set_state` checks the whole state before it changes anything."""

  def get_state(self) -> dict[str, Any]:
    return self.state_of(self.position())

  def set_state(self, state: dict[str, Any]) -> None:
    position = self.parse_state(state)
    self.forget_prefetched()
    self.restore(position)


def with_stage_timing(ds: grain.IterDataset) -> grain.IterDataset:
  """`ds` with Grain's stage timing switched on (what `StageIterator.stage_seconds` reads)."""
  options = grain.experimental.DatasetOptions(
      execution_tracking_mode=grain.experimental.ExecutionTrackingMode.STAGE_TIMING)
  return grain.experimental.WithOptionsIterDataset(ds, options)


@contextlib.contextmanager
def interrupts_held():
  """Holds a Ctrl-C (SIGINT) back until the block is done: for steps that must not stop
  half-way, such as putting a position back. Only the main thread receives it."""
  if (threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGINT) is None):  # a handler Python did not install
    yield
    return
  received = []
  previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)
    if received and callable(previous):
      previous(signal.SIGINT, received[0])
    elif received and previous == signal.SIG_DFL:
      signal.raise_signal(signal.SIGINT)
