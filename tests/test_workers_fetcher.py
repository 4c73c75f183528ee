"""The fetcher: elements by (group, index), the same from worker processes as inline.

Runs its worker processes under a deadline (signal.alarm): a hang fails the test. The
scenarios that involve a user's script (start-up, signals, fork, exit) run it as a real
script file in a child process of its own session (spawned workers re-import it, signals
go to its group), under a timeout; whatever it leaves running is killed by pid before
the assertions.
"""

import contextlib
import dataclasses
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
import weakref
from pathlib import Path

import numpy as np
import psutil
import pytest

from bagel_grain import c_heap, held_memory
from bagel_grain.sources import readahead
from bagel_grain.families.files import DiskFiles
from bagel_grain.workers import WORKER_NICENESS, Fetcher, WorkerError
from bagel_grain.workers import fetcher as fetcher_module
from bagel_grain.pipeline import build_pipeline
from deadline import deadline
from slow_elements import FailsWhileDown, LoadsOnlyWhenAllowed, StallsInWorkers
from bagel_grain.errors import StorageUnavailableError


class Squares:
  """A group whose element i is [i*i] * 3, or an error at `bad`."""

  def __init__(self, size, bad=None):
    self.size, self.bad = size, bad

  def __len__(self):
    return self.size

  def __getitem__(self, index):
    if index == self.bad:
      raise ValueError(f"element {index} is bad")
    return np.full(3, index * index)


def workers_alive():
  return [p for p in psutil.Process().children(recursive=True)
          if "resource_tracker" not in " ".join(p.cmdline()) and p.status() != "zombie"]


def test_inline_fetcher_computes_what_it_is_asked_for():
  fetcher = Fetcher([Squares(5), Squares(4)], workers=0, depths=[0, 0])
  assert fetcher.get(1, 3).tolist() == [9, 9, 9]
  assert [a.tolist() for a in fetcher.get_many([(0, 2), (1, 1)])] == [[4] * 3, [1] * 3]
  fetcher.close()
  fetcher.close()



class _Unavailable(StorageUnavailableError):
  """One that a weak reference can follow."""


class UnavailableAt(Squares):
  def __getitem__(self, index):
    if index == 0:
      raise _Unavailable("element 0", "TimeoutError", 24.0, 2)
    return super().__getitem__(index)


def test_a_storage_error_raised_by_get_is_freed_with_its_last_reference():
  """Its traceback holds the frames of the failed step (a batch buffer, samples): no
  reference cycle may keep them until a full collection runs (issue 27's soak)."""
  fetcher = Fetcher([UnavailableAt(3)], workers=0, depths=[0])
  gc.disable()
  try:
    try:
      fetcher.get(0, 0)
    except _Unavailable as e:
      raised = weakref.ref(e)
    assert raised() is None
  finally:
    gc.enable()
    fetcher.close()


class Counted(Squares):
  """Squares that count how often each element was computed, and say when one was."""

  def __init__(self, size):
    super().__init__(size)
    self.computed, self.changed = [], threading.Condition()

  def __getitem__(self, index):
    if index >= self.size:
      raise IndexError(f"element {index} of {self.size}")
    value = super().__getitem__(index)
    with self.changed:
      self.computed.append(index)
      self.changed.notify_all()
    return value


def test_inline_fetcher_computes_the_next_element_while_the_caller_is_away():
  # Without workers the packer's own work overlaps the decode of what it asks next.
  group = Counted(4)
  fetcher = Fetcher([group, Squares(3)], workers=0, depths=[0, 0])
  try:
    assert fetcher.get(0, 1)[0] == 1
    with deadline(60), group.changed:
      group.changed.wait_for(lambda: 2 in group.computed)
    assert fetcher.get(0, 2)[0] == 4  # taken, not computed again
    assert fetcher.get(0, 3)[0] == 9  # the last: nothing past the end is asked for
    assert fetcher.get(1, 2)[0] == 4
    with deadline(60), group.changed:
      group.changed.wait_for(lambda: len(group.computed) >= 3)
    assert group.computed == [1, 2, 3]  # each once, in order, one ahead at most
    with pytest.raises(IndexError):
      fetcher.get(0, 4)  # asked past the end: the group's own error, not a hang
  finally:
    fetcher.close()

def test_workers_run_at_a_lower_priority_than_the_main_process():
  # They work ahead; the main process (packer, trainer) is the critical path, and on a
  # busy host starting workers must not slow its first batch.
  with deadline(120):
    fetcher = Fetcher([Squares(8)], workers=2, depths=[2])
    try:
      assert fetcher.get(0, 3)[0] == 9
      mine = os.getpriority(os.PRIO_PROCESS, 0)
      assert [os.getpriority(os.PRIO_PROCESS, p.pid) for p in workers_alive()] == [
          min(19, mine + WORKER_NICENESS)] * 2
    finally:
      fetcher.close()


def test_workers_give_the_same_elements_in_any_order_then_fail_clearly_and_leave():
  groups = [Squares(40), Squares(30, bad=25)]
  order = [(1, 0), (0, 0), (0, 1), (1, 1), (0, 2), (1, 2), (1, 3), (0, 3)]
  with deadline(120):
    fetcher = Fetcher(groups, workers=2, depths=[4, 4])
    try:
      got = [fetcher.get(g, i) for g, i in order]
      assert [a.tolist() for a in got] == [groups[g][i].tolist() for g, i in order]
      many = fetcher.get_many([(0, 30), (1, 20), (0, 31)])
      assert [a[0] for a in many] == [900, 400, 961]
      fetcher.reset()  # forgets what it computed ahead; still answers
      assert fetcher.get(0, 5)[0] == 25
      # A failing element is raised, from a worker or from the main process when the
      # element was not handed out yet: never a hang, never a skipped element.
      with pytest.raises((WorkerError, ValueError), match="element 25"):
        for i in range(4, 30):
          assert fetcher.get(1, i)[0] == i * i
    finally:
      fetcher.close()
      fetcher.close()
    assert not psutil.wait_procs(workers_alive(), timeout=5)[1]


# --- misuse: start-up, signals, fork, exit, stalls ---------------------------------------

PRELUDE = textwrap.dedent("""
    import json, os, signal, sys, time
    import psutil
    from bagel_grain.configs import load_shipped
    from bagel_grain.workers import WorkerError
    from bagel_grain.pipeline import build_pipeline
    from bagel_grain.tokenizer import load_tokenizer

    def demo_iterator(workers):
      demo = sys.argv[1]
      tokenizer = load_tokenizer(demo + "/tokenizer/tokenizer.json")
      return iter(build_pipeline(load_shipped("demo", demo), tokenizer, batch_size=1,
                                 workers=workers))

    def workers_of(me):
      # the pool's workers, not multiprocessing's resource tracker
      return [p for p in me.children() if "resource_tracker" not in " ".join(p.cmdline())]

    def running(batches):
      # an iterator with two workers that gave `batches` batches, and its workers
      it = demo_iterator(workers=2)
      for _ in range(batches):
        next(it)
      return it, workers_of(psutil.Process())

    def alive(processes):
      return [p.pid for p in processes if p.is_running() and p.status() != "zombie"]

    def say(**out):
      print(json.dumps(out), flush=True)
""")


def run_script(tmp_path: Path, body: str, demo_dir: Path, *, timeout: float = 180,
               signal_after_first_line: int | None = None, to_group: bool = False):
  """Runs PRELUDE + body as a script file; returns (its JSON lines, stderr, leftover pids).

  With `signal_after_first_line`, that signal goes to the script (or its whole
  process group) once it has printed its first line.
  """
  script = tmp_path / "user_script.py"
  script.write_text(PRELUDE + textwrap.dedent(body))
  child = subprocess.Popen([sys.executable, str(script), str(demo_dir)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, cwd=tmp_path)
  family = []
  try:
    if signal_after_first_line is not None:
      first = child.stdout.readline()
      with contextlib.suppress(psutil.Error):
        family = psutil.Process(child.pid).children(recursive=True)
      (os.killpg if to_group else os.kill)(child.pid, signal_after_first_line)
    else:
      first = ""
    stdout, stderr = child.communicate(timeout=timeout)
    stdout = first + stdout
  except subprocess.TimeoutExpired:
    with contextlib.suppress(psutil.Error):
      family += psutil.Process(child.pid).children(recursive=True)
    child.kill()
    stdout, stderr = child.communicate()
    stdout += '\n{"failure": "the script hung"}'
  lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
  pids = {pid for line in lines for pid in line.get("workers", [])}
  family += [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
  _, alive = psutil.wait_procs(family, timeout=10)
  leftovers = []
  for p in alive:
    with contextlib.suppress(psutil.Error):
      if p.status() != psutil.STATUS_ZOMBIE:
        leftovers.append(p.pid)
        p.kill()
  return lines, stderr, leftovers


@pytest.fixture(scope="module")
def padded_demo(demo_dir, tmp_path_factory):
  """The demo data with a 24,000-line VLM file: its datasets pickle to far more than a pipe holds."""
  out = tmp_path_factory.mktemp("padded") / "demo"
  shutil.copytree(demo_dir, out)
  jsonl = out / "vlm" / "sft.jsonl"
  jsonl.write_text(jsonl.read_text() * 400)
  return out


def test_script_without_main_guard_fails_fast_and_names_the_guard(tmp_path, padded_demo):
  lines, stderr, leftovers = run_script(tmp_path, """
      it = demo_iterator(workers=2)
      try:
        while True:
          next(it)
      except Exception as e:
        say(error=type(e).__name__, message=str(e))
      it.close()
  """, padded_demo)
  assert lines and lines[-1].get("error") == "WorkerError", (lines, stderr[-3000:])
  assert 'if __name__ == "__main__":' in lines[-1]["message"]
  assert leftovers == []


def test_workers_ignore_ctrl_c_sent_to_the_process_group(tmp_path, demo_dir):
  lines, stderr, leftovers = run_script(tmp_path, """
      def main():
        it, workers = running(2)
        try:  # the signal may come as soon as the line is out
          say(workers=[p.pid for p in workers])
          time.sleep(120)
        except KeyboardInterrupt:
          pass
        for _ in range(8):
          next(it)
        say(batches=8, alive=alive(workers))
        it.close()

      if __name__ == "__main__":
        main()
  """, demo_dir, signal_after_first_line=signal.SIGINT, to_group=True)
  assert len(lines) == 2, (lines, stderr[-3000:])
  assert sorted(lines[1]["alive"]) == sorted(lines[0]["workers"]) and len(lines[0]["workers"]) == 2
  assert "KeyboardInterrupt" not in stderr and leftovers == []


def test_sigterm_to_the_main_process_ends_the_workers_quietly(tmp_path, demo_dir):
  lines, stderr, leftovers = run_script(tmp_path, """
      def main():
        it, workers = running(1)
        say(workers=[p.pid for p in workers])
        while True:
          next(it)

      if __name__ == "__main__":
        main()
  """, demo_dir, signal_after_first_line=signal.SIGTERM)
  assert len(lines[0]["workers"]) == 2, (lines, stderr[-3000:])
  assert "Traceback" not in stderr and "Error" not in stderr, stderr[-3000:]
  assert leftovers == []


def test_exit_without_close_is_quiet_and_leaves_no_worker(tmp_path, demo_dir):
  lines, stderr, leftovers = run_script(tmp_path, """
      if __name__ == "__main__":
        it, workers = running(3)  # a global: still alive when the interpreter shuts down
        say(workers=[p.pid for p in workers])
  """, demo_dir)
  assert len(lines) == 1 and len(lines[0]["workers"]) == 2, (lines, stderr[-3000:])
  assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
  assert leftovers == []


def test_forked_child_gets_a_clear_error_and_its_exit_spares_the_parents_workers(tmp_path,
                                                                                 demo_dir):
  lines, stderr, leftovers = run_script(tmp_path, """
      def main():
        it, workers = running(3)
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the child: uses the inherited iterator, then exits normally
          signal.alarm(20)
          try:
            next(it)
            said = "a batch"
          except WorkerError as e:
            said = "WorkerError: " + str(e)
          except BaseException as e:
            said = type(e).__name__
          os.write(write_end, said.encode())
          sys.exit(0)
        os.close(write_end)
        child_said = os.read(read_end, 100000).decode()
        os.waitpid(pid, 0)
        for _ in range(8):
          next(it)
        say(child=child_said, workers=[p.pid for p in workers], alive=alive(workers))
        it.close()

      if __name__ == "__main__":
        main()
  """, demo_dir)
  assert len(lines) == 1, (lines, stderr[-3000:])
  assert lines[0]["child"].startswith("WorkerError") and "fork" in lines[0]["child"]
  assert sorted(lines[0]["alive"]) == sorted(lines[0]["workers"]) and len(lines[0]["workers"]) == 2
  assert leftovers == []


def test_unpicklable_dataset_is_refused_before_any_worker_starts():
  with pytest.raises(WorkerError, match="cannot be sent to worker processes"):
    Fetcher([[lambda: 1]], workers=1, depths=[0])


def test_dataset_that_does_not_load_in_a_worker_is_a_worker_error_with_its_traceback():
  module = types.ModuleType("bagel_grain_test_only_in_this_process")
  exec("class Elements(list):\n  pass", module.__dict__)  # pylint: disable=exec-used
  sys.modules[module.__name__] = module
  try:
    with deadline(120), pytest.raises(WorkerError) as failure:
      fetcher = Fetcher([module.Elements(range(10**6))], workers=1, depths=[2])
      try:
        for i in range(10**9):  # the main process computes them until the worker's failure
          fetcher.get(0, i % 10**6)
      finally:
        fetcher.close()
  finally:
    del sys.modules[module.__name__]
  assert "could not load the pipeline's datasets" in str(failure.value)
  assert "ModuleNotFoundError" in str(failure.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_storage_that_gave_up_is_raised_once_and_the_element_computed_again(tmp_path, workers):
  # Not a failure of the fetcher: the packer sees the error, and asking again (storage
  # back) gives the element; what failed ahead meanwhile is computed again, not raised.
  down = tmp_path / "down"
  down.touch()
  with deadline(120):
    fetcher = Fetcher([FailsWhileDown(20, str(down))], workers=workers, depths=[4])
    try:
      with pytest.raises(StorageUnavailableError, match="element 3"):
        fetcher.get(0, 3)
      if workers:  # the elements after 3 were handed out too: wait until they failed
        while any(w.jobs for w in fetcher._workers):  # pylint: disable=protected-access
          time.sleep(0.05)
      down.unlink()
      assert [fetcher.get(0, i) for i in range(3, 20)] == list(range(3, 20))
    finally:
      fetcher.close()
  assert not workers_alive()


def test_element_stalled_in_a_worker_is_an_error_naming_it():
  # Elements are slow enough in this process for the worker to start and take some.
  with deadline(120), pytest.raises(WorkerError) as failure:
    fetcher = Fetcher([StallsInWorkers(10**6, parent_delay_s=0.01)], workers=1, depths=[3],
                      timeout_s=1, describe=lambda g, i: f"group 'g{g}' element {i} (record r{i})")
    try:
      for i in range(10**6):
        fetcher.get(0, i)
    finally:
      fetcher.close()
  message = str(failure.value)
  assert re.search(r"group 'g0' element (\d+) \(record r\1\) took longer than "
                   r"element_timeout_s = 1 s in worker process \d+", message), message


def test_stalled_read_in_the_main_process_is_an_error_naming_group_index_and_record(
    demo_config, demo_tokenizer, monkeypatch):
  cfg = dataclasses.replace(demo_config, element_timeout_s=1)
  release = threading.Event()
  monkeypatch.setattr(DiskFiles, "read", lambda self, path: release.wait())
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=1, workers=0))
  try:
    with deadline(60), pytest.raises(WorkerError) as failure:
      next(it)
  finally:
    release.set()
    it.close()
  assert re.search(r"group 'vlm_sft' element \d+ \(record .*sft\.jsonl:\d+\) took longer than "
                   r"element_timeout_s = 1 s in this process", str(failure.value)), failure.value


def test_a_worker_killed_while_starting_is_named_killed_not_unguarded():
  fetcher = Fetcher([Squares(10**6)], workers=1, depths=[2], timeout_s=60)
  try:
    with deadline(60):
      (worker,) = workers_alive()
      worker.kill()  # within milliseconds of its spawn: it is still importing
      with pytest.raises(WorkerError) as e:
        for index in range(10**6):  # computed inline until the pump notices the death
          fetcher.get(0, index)
  finally:
    fetcher.close()
  message = str(e.value)
  assert f"worker process {worker.pid} was killed by SIGKILL (exit code -9)" in message
  assert "__main__" not in message


class HoldsBytes(Squares):
  """Squares whose copy in a worker registers a holder of 12,345 bytes once an element of
  it is computed (0 before): what the worker reports back."""

  def __setstate__(self, state):
    self.__dict__.update(state, computed=False)
    held_memory.register(self, held_memory.ROW_GROUP_CACHE,
                         lambda holder: 12_345 if holder.computed else 0)

  def __getitem__(self, index):
    time.sleep(0.02)  # slow enough for the worker to take some from the main process
    self.computed = True
    return super().__getitem__(index)


def test_workers_report_their_memory_after_imports_loading_and_each_element():
  with deadline(120):
    fetcher = Fetcher([HoldsBytes(10_000)], workers=1, depths=[4])
    try:
      index = 0
      while "now" not in fetcher.worker_memory()[0]:
        fetcher.get(0, index)
        index += 1
      (memory,) = fetcher.worker_memory()
    finally:
      fetcher.close()
  assert memory["pid"] > 0
  assert 0 < memory["at_hello"]["rss_bytes"] <= memory["at_ready"]["rss_bytes"] * 1.1
  assert memory["at_hello"][held_memory.ROW_GROUP_CACHE] == 0  # no datasets yet
  assert memory["at_ready"][held_memory.ROW_GROUP_CACHE] == 0  # loaded, nothing computed
  assert memory["now"][held_memory.ROW_GROUP_CACHE] == 12_345
  assert memory["now"][held_memory.READ_AHEAD] == 0


def test_elements_no_worker_has_taken_are_read_ahead_by_the_main_process(monkeypatch):
  # While the worker starts, the main process computes the first elements itself: at its
  # first, every group's first ones get their reads started (then, before each, those of
  # its group that no worker has taken).
  started = []
  monkeypatch.setattr(readahead, "read_ahead_of",
                      lambda dataset, indices: started.append((dataset.size, list(indices))))
  with deadline(120):
    fetcher = Fetcher([Squares(40), Squares(3)], workers=1, depths=[8, 8])
    try:
      assert np.array_equal(fetcher.get(0, 0), np.zeros(3))
    finally:
      fetcher.close()
  ahead = fetcher_module.INLINE_READ_AHEAD
  assert started[:2] == [(40, list(range(1, ahead))), (3, [0, 1, 2])]


def test_with_workers_the_main_process_gives_freed_heap_pages_back_now_and_then(
    tmp_path, monkeypatch):
  # Stragglers (elements the main process computes while workers run) and its read-ahead
  # touch memory that its malloc arenas keep when freed: at most every TRIM_INTERVAL_S the
  # freed pages go back (the soak's main process grew by tens of MiB so). Here the one
  # worker stays loading, so the main process computes every element itself; without
  # workers nothing is trimmed.
  trims = []
  monkeypatch.setattr(c_heap, "release_freed", lambda: trims.append(1) or True)

  def trims_in_nine_gets(interval_s: float) -> int:
    monkeypatch.setattr(c_heap, "TRIM_INTERVAL_S", interval_s)
    with deadline(120):
      fetcher = Fetcher([LoadsOnlyWhenAllowed(100, str(tmp_path / "allowed"))], workers=1,
                        depths=[2])
      try:
        assert [fetcher.get(0, i) for i in range(9)] == list(range(9))
      finally:
        fetcher.close()
    return fetcher.heap_trims

  assert trims_in_nine_gets(0.0) == len(trims) == 9  # every get may trim
  assert trims_in_nine_gets(3600.0) == 1 and len(trims) == 10  # the first get's, then none
  inline_only = Fetcher([Squares(100)], workers=0, depths=[2])
  try:
    for i in range(9):
      inline_only.get(0, i)
  finally:
    inline_only.close()
  assert len(trims) == 10 and inline_only.heap_trims == 0


def test_with_workers_the_main_process_keeps_its_thread_arenas_tops_trimmed(monkeypatch):
  # Its threads' freed image-sized blocks stayed at their arenas' tops, which malloc_trim
  # does not give back (c_heap); with workers the fetcher sets glibc's trim threshold,
  # without them the host's allocator is left as it is.
  calls = []
  monkeypatch.setattr(c_heap, "keep_thread_tops_trimmed", lambda: calls.append(1) or True)
  inline_only = Fetcher([Squares(10)], workers=0, depths=[2])
  try:
    assert np.array_equal(inline_only.get(0, 3), np.full(3, 9))
  finally:
    inline_only.close()
  assert not calls
  with deadline(120):
    fetcher = Fetcher([Squares(10)], workers=1, depths=[2])
    try:
      assert np.array_equal(fetcher.get(0, 3), np.full(3, 9))
    finally:
      fetcher.close()
  assert calls == [1]
