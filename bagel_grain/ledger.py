"""The data ledger: which samples each training step took, per process, in Parquet files
beside the checkpoints, so "what was in step N" and "which steps saw record X" are a
read, not a replay.

Opt-in: `device_iterator(..., ledger=DIR)`. For every batch the training loop takes
from the iterator (`next()` in the caller's thread, never the prefetch thread's
batches still queued), the ledger holds one line per sample: the data step (batches
taken since the stream's start), process, row, logical shard, position in the row,
group, sample index, epoch, record id and tokens. `bagel_grain.jax.save` writes the
lines taken since the last save as one segment per process, before the checkpoint
itself, atomically (a temporary file, then a rename).

A restore starts a new *generation* at the restored step: the lines of earlier
generations at or past that step are superseded (a step appears once, with the batch
trained after the restore), the files kept. Names carry what a query needs
(generation, the step it began at, process, steps held), so `--step N` reads only the
segments that hold N. Every file carries the ledger's run identity (`LEDGER.json`);
one of another run, or one cut short, is refused by name (docs/debugging.md).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from etils import epath

from bagel_grain.errors import BagelGrainError

VERSION = 1
IDENTITY = "LEDGER.json"
_META_KEY = b"bagel_grain_ledger"
_SEGMENT = re.compile(r"g(\d{6})-from(\d{12})-p(\d{5})-steps(\d{12})-(\d{12})\.parquet")
_BEGIN = re.compile(r"g(\d{6})-from(\d{12})\.begin\.json")
SCHEMA = pa.schema([
    ("step", pa.int64()), ("process", pa.int16()), ("row", pa.int16()),
    ("shard", pa.int16()), ("slot", pa.int16()), ("group", pa.string()),
    ("index", pa.int64()), ("epoch", pa.int32()), ("record", pa.string()),
    ("tokens", pa.int32())])
_PER_ROW = ("row", "shard", "slot", "group", "index", "epoch", "record", "tokens")


class LedgerError(BagelGrainError):
  """A ledger file that cannot be read as this run's data (cut short, another run's)."""


@dataclasses.dataclass(frozen=True)
class StepRows:
  """One batch's samples as ledger columns (all but `step` and `process`)."""

  row: np.ndarray
  shard: np.ndarray
  slot: np.ndarray
  group: list[str]
  index: np.ndarray
  epoch: np.ndarray
  record: list[str]
  tokens: np.ndarray


def row_shards(before: Any, after: Any, rows: int) -> list[int]:
  """The logical shard that packed each of a batch's `rows` rows, from the pipeline's
  states before and after it: the interleaving takes the shard with the fewest rows so
  far (the lowest on a tie) among those that made one (`packing/shards.py`). -1 where
  the states are not the pipeline's."""
  if not all(isinstance(s, dict) and "shards" in s and "logical_shards" in s
             for s in (before, after)):
    return [-1] * rows
  done = {int(s): int(e["rows"]) for s, e in before["shards"].items()}
  left = {int(s): int(e["rows"]) - done.get(int(s), 0) for s, e in after["shards"].items()}
  out = []
  for _ in range(rows):
    live = [s for s, n in left.items() if n > 0]
    if not live:
      out.append(-1)
      continue
    shard = min(live, key=lambda s: (done.get(s, 0), s))
    out.append(shard)
    done[shard] = done.get(shard, 0) + 1
    left[shard] -= 1
  return out


def step_rows(batch: Mapping[str, Any], before: Any, after: Any) -> StepRows:
  """A host batch's ledger lines (computed in the prefetch thread, beside the transfer)."""
  keys = batch["sample_keys"]
  shard_of = row_shards(before, after, sum(1 for k in keys if k))
  segments = np.asarray(batch["segment_ids"])
  cols: dict[str, list] = {name: [] for name in _PER_ROW}
  for r, row_keys in enumerate(keys):
    if not row_keys:
      continue
    tokens = np.bincount(segments[r], minlength=len(row_keys) + 1)[1:len(row_keys) + 1]
    for slot, (group, index, epoch, record) in enumerate(row_keys):
      for name, value in zip(_PER_ROW, (r, shard_of[r], slot, group, index, epoch, record,
                                        tokens[slot])):
        cols[name].append(value)
  return StepRows(
      row=np.asarray(cols["row"], np.int16), shard=np.asarray(cols["shard"], np.int16),
      slot=np.asarray(cols["slot"], np.int16), group=cols["group"],
      index=np.asarray(cols["index"], np.int64), epoch=np.asarray(cols["epoch"], np.int32),
      record=cols["record"], tokens=np.asarray(cols["tokens"], np.int32))


# -- names ----------------------------------------------------------------------------


def segment_name(generation: int, begins: int, process: int, first: int, last: int) -> str:
  return f"g{generation:06d}-from{begins:012d}-p{process:05d}-steps{first:012d}-{last:012d}.parquet"


def begin_name(generation: int, begins: int) -> str:
  return f"g{generation:06d}-from{begins:012d}.begin.json"


def _write_atomically(path: epath.Path, data: bytes) -> None:
  """Whole or absent under `path`: a reader never sees a file cut short by a kill."""
  tmp = path.parent / f".tmp-{secrets.token_hex(4)}-{path.name}"
  tmp.write_bytes(data)
  tmp.rename(path)


# -- writing --------------------------------------------------------------------------


def _alone(value: np.ndarray) -> np.ndarray:
  return value


class Ledger:
  """One process's writer (`device_iterator(..., ledger=...)` makes it).

  `begin(step)` (every process, together: process 0 chooses the run identity and the
  generation, and `broadcast` hands its choice to all, as
  `multihost_utils.broadcast_one_to_all` does) starts a generation at `step`; `record`
  keeps a batch's lines in memory; `flush` writes them as one segment
  (`bagel_grain.jax.save` calls it).
  """

  def __init__(self, directory: str | epath.PathLike, *, process_index: int = 0,
               process_count: int = 1,
               broadcast: Callable[[np.ndarray], np.ndarray] = _alone):
    self.directory = epath.Path(directory)
    self._process, self._processes, self._broadcast = process_index, process_count, broadcast
    self._pending: list[tuple[int, StepRows]] = []
    self._run = ""
    self._generation = self._begins = -1

  def begin(self, step: int, *, restored: bool = False) -> None:
    """A new generation from `step` (0 at the start, the restored step after a restore).
    A restore writes a marker, so the lines it supersedes are superseded even before
    this generation writes any; lines taken and not flushed are dropped (a restore
    goes back to before them)."""
    self.directory.mkdir(parents=True, exist_ok=True)
    mine = np.zeros(2, np.int32)
    if self._process == 0:
      files = LedgerFiles.listing(self.directory)
      run = files.run or f"{secrets.randbits(31):08x}"
      if files.run is None:
        _write_atomically(self.directory / IDENTITY,
                          json.dumps({"version": VERSION, "run": run}).encode())
      mine[:] = int(run, 16), files.next_generation
    agreed = np.asarray(self._broadcast(mine))
    self._run, self._generation = f"{int(agreed[0]):08x}", int(agreed[1])
    self._begins = int(step)
    self._pending.clear()
    if restored and self._process == 0:
      _write_atomically(self.directory / begin_name(self._generation, self._begins), json.dumps(
          {"version": VERSION, "run": self._run, "generation": self._generation,
           "begins": self._begins, "processes": self._processes}).encode())

  def record(self, step: int, rows: StepRows) -> None:
    """The training loop took batch `step`: keep its lines (no I/O)."""
    self._pending.append((step, rows))

  def flush(self) -> epath.Path | None:
    """Writes the lines taken since the last flush as one segment; None if there were none."""
    if not self._pending:
      return None
    if self._generation < 0:
      raise LedgerError(f"the ledger in {self.directory} was never begun: make it with "
                        "bagel_grain.jax.device_iterator(..., ledger=...)")
    steps = [s for s, _ in self._pending]
    table = pa.table({
        "step": np.repeat(np.asarray(steps, np.int64), [len(r.row) for _, r in self._pending]),
        "process": np.full(sum(len(r.row) for _, r in self._pending), self._process, np.int16),
        **{name: _joined([getattr(r, name) for _, r in self._pending])
           for name in _PER_ROW}}, schema=SCHEMA)
    meta = {"version": VERSION, "run": self._run, "generation": self._generation,
            "begins": self._begins, "process": self._process, "first": steps[0],
            "last": steps[-1], "lines": table.num_rows}
    table = table.replace_schema_metadata({_META_KEY: json.dumps(meta).encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", use_dictionary=True,
                   row_group_size=1 << 20)
    path = self.directory / segment_name(self._generation, self._begins, self._process,
                                         steps[0], steps[-1])
    _write_atomically(path, sink.getvalue().to_pybytes())
    self._pending.clear()
    return path


def _joined(parts: Sequence[Any]) -> Any:
  if parts and isinstance(parts[0], list):
    return [x for part in parts for x in part]
  return np.concatenate(parts) if parts else np.zeros(0)


# -- reading --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Segment:
  path: epath.Path
  generation: int
  begins: int
  process: int
  first: int
  last: int


class LedgerFiles:
  """A ledger folder, read: its segments, and which generation holds each step."""

  def __init__(self, directory: epath.Path, run: str | None, segments: list[Segment],
               begins: dict[int, int]):
    self.directory, self.run, self.segments = directory, run, segments
    self._begins = begins  # generation -> the step it began at

  @classmethod
  def listing(cls, directory: str | epath.PathLike) -> LedgerFiles:
    """Names only (nothing but `LEDGER.json` is read)."""
    directory = epath.Path(directory)
    if (directory / "data_ledger").is_dir():  # the checkpoint folder was given
      directory = directory / "data_ledger"
    segments, begins, markers, run = [], {}, [], None
    if (directory / IDENTITY).exists():
      try:
        run = str(json.loads((directory / IDENTITY).read_text())["run"])
      except (ValueError, KeyError, TypeError) as e:
        raise LedgerError(f"{directory / IDENTITY} is not a ledger identity ({e}): the ledger "
                          "folder holds something else; point at the right folder") from e
    for path in (directory.iterdir() if directory.is_dir() else ()):
      if m := _SEGMENT.fullmatch(path.name):
        g, b, p, first, last = map(int, m.groups())
        segments.append(Segment(path, g, b, p, first, last))
        begins.setdefault(g, b)
      elif m := _BEGIN.fullmatch(path.name):
        begins.setdefault(int(m.group(1)), int(m.group(2)))
        markers.append(path)
    for path in markers:  # one per restore: few, and each decides what is superseded
      _check_marker(path, run)
    if segments and run is None:
      raise LedgerError(f"{directory} holds ledger segments but no {IDENTITY}: not one run's "
                        "ledger (a partial copy?)")
    return cls(directory, run, sorted(segments, key=lambda s: (s.generation, s.process,
                                                               s.first)), begins)

  @property
  def next_generation(self) -> int:
    return max(self._begins, default=-1) + 1

  def valid_until(self, generation: int) -> float:
    """Lines of `generation` at this step or later are superseded by a later restore."""
    later = [b for g, b in self._begins.items() if g > generation]
    return min(later, default=float("inf"))

  def last_step(self) -> int:
    return max((min(s.last, self.valid_until(s.generation) - 1) for s in self.segments),
               default=-1)

  def read(self, segment: Segment, *, columns: Sequence[str] | None = None,
           where: Callable[[pa.Table], Any] | None = None) -> pa.Table:
    """A segment's lines still valid (and those `where` keeps: a mask of the table of
    `columns`), the file checked to be whole and of this run."""
    parquet = self._opened(segment)
    try:
      table = parquet.read(columns=columns)
    except (pa.ArrowException, OSError) as e:
      raise LedgerError(f"ledger segment {segment.path} cannot be read ({e}): cut short? "
                        "Move it aside; its steps are then missing from the ledger") from e
    until = self.valid_until(segment.generation)
    if until != float("inf"):
      table = table.filter(pc.less(table["step"], until))
    return table.filter(where(table)) if where is not None else table

  def _opened(self, segment: Segment) -> pq.ParquetFile:
    try:
      parquet = pq.ParquetFile(segment.path)
      meta = json.loads(parquet.schema_arrow.metadata[_META_KEY])
      lines = parquet.metadata.num_rows
    except (pa.ArrowException, OSError, KeyError, TypeError, ValueError) as e:
      raise LedgerError(f"ledger segment {segment.path} is not a whole ledger file ({e}): a "
                        "host killed mid-write, or a copy cut short? Move it aside; its steps "
                        "are then missing from the ledger") from e
    if meta.get("run") != self.run:
      raise LedgerError(f"ledger segment {segment.path} belongs to run {meta.get('run')!r}, "
                        f"not to this ledger's run {self.run!r} ({self.directory / IDENTITY}): "
                        "a file of another run; remove it")
    named = {"generation": segment.generation, "begins": segment.begins,
             "process": segment.process, "first": segment.first, "last": segment.last,
             "lines": lines}
    differs = {k: (v, meta.get(k)) for k, v in named.items() if meta.get(k) != v}
    if differs:
      raise LedgerError(f"ledger segment {segment.path} does not hold what its name says "
                        f"({', '.join(f'{k}: named {a}, holds {b}' for k, (a, b) in differs.items())}"
                        "): renamed or cut short? Remove it")
    return parquet

  def at_step(self, step: int) -> pa.Table:
    """Every process's lines of `step`, ordered by process, row and slot."""
    holding = [s for s in self.segments if s.first <= step <= s.last
               and s.begins <= step < self.valid_until(s.generation)]
    return _sorted(_concat([self.read(s, where=lambda t: pc.equal(t["step"], step))
                            for s in holding]))

  def of_record(self, record: str) -> pa.Table:
    """Every line of `record`, in step order (every segment is read)."""
    found = []
    for segment in self.segments:
      hits = self.read(segment, columns=["step", "record"],
                       where=lambda t: pc.equal(t["record"], record))
      if hits.num_rows:  # the whole lines of the few segments that hold it
        found.append(self.read(segment, where=lambda t: pc.equal(t["record"], record)))
    return _sorted(_concat(found))

  def stats(self) -> dict[str, dict[str, int]]:
    """Per group: samples trained, tokens, and the highest epoch reached, over the whole
    ledger (one segment in memory at a time)."""
    out: dict[str, dict[str, int]] = {}
    for segment in self.segments:
      table = self.read(segment, columns=["step", "group", "epoch", "tokens"])
      for row in table.group_by("group").aggregate(
          [("group", "count"), ("tokens", "sum"), ("epoch", "max")]).to_pylist():
        counts = out.setdefault(row["group"], {"samples": 0, "tokens": 0, "epoch": 0})
        counts["samples"] += row["group_count"]
        counts["tokens"] += row["tokens_sum"] or 0
        counts["epoch"] = max(counts["epoch"], row["epoch_max"] or 0)
    return dict(sorted(out.items()))


def _check_marker(path: epath.Path, run: str | None) -> None:
  """A restore's marker is whole and of this run (a foreign one would hide lines)."""
  try:
    marker = json.loads(path.read_text())
    owner = marker["run"]
  except (ValueError, KeyError, TypeError) as e:
    raise LedgerError(f"ledger marker {path} is not a whole marker ({e}): a copy cut short? "
                      "Remove it; the lines it superseded then count again") from e
  if owner != run:
    raise LedgerError(f"ledger marker {path} belongs to run {owner!r}, not to this ledger's "
                      f"run {run!r}: a file of another run; remove it")


def _concat(tables: Iterable[pa.Table]) -> pa.Table:
  tables = [t.replace_schema_metadata(None) for t in tables]
  if not tables:
    return SCHEMA.empty_table()
  return pa.concat_tables(tables, promote_options="permissive")


def _sorted(table: pa.Table) -> pa.Table:
  keys = [(k, "ascending") for k in ("step", "process", "row", "slot") if k in table.column_names]
  return table.sort_by(keys) if table.num_rows else table


def open_ledger(directory: str | epath.PathLike) -> LedgerFiles:
  """A ledger folder (or the checkpoint folder holding `data_ledger/`) to query."""
  files = LedgerFiles.listing(directory)
  if files.run is None:
    raise LedgerError(f"no ledger in {directory} (no {IDENTITY}): was the run made with "
                      "device_iterator(..., ledger=...)?")
  return files
