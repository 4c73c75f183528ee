"""What the packer's stage iterators share: `with` closes them, and their own time is Grain's.

Each stage reports the time of its own work through Grain's dataset statistics
(`record_self_time`), less the time it spent waiting on what feeds it (its parent
stage, or the fetcher's decoding), so `grain.experimental.get_execution_summary`
shows where the main process spends its time, stage by stage
(`StageIterator.stage_seconds`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Callable, TypeVar

import grain

try:
  from grain.experimental import get_execution_summary
except ImportError:  # Grain 0.2.18 has it, not yet exported
  from grain._src.python.dataset.dataset import get_execution_summary  # pylint: disable=ungrouped-imports

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
    """Seconds of own work so far of this stage and those feeding it, by iterator name,
    from Grain's execution summary (switch it on with `with_stage_timing`)."""
    try:
      self._stats.report()  # fold in what was recorded since Grain's last periodic report
    except IndexError:  # Grain's reporting thread emptied a buffer at the same moment
      self._stats.report()
    summary = get_execution_summary(self)
    return {node.name.split("(")[0]: node.total_processing_time_ns / 1e9
            for node in summary.nodes.values()}

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
