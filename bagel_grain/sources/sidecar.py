"""The sidecar index of a corpus: what a build must know about the files, written once.

`bagel-grain index CONFIG` writes it next to the data, so every host finds it;
a build that finds it fresh reads nothing else about the corpus (no parquet
footer, no JSONL scan), and one that does not find it scans as before, with a
warning. A stale index (a file changed after it was written) is refused.

- A parquet dataset folder gets `.bagel_index.arrow` (Arrow IPC): one row per
  parquet file with its name, identity (`identity.Identity`: size, checksums, probe,
  and the time it had where it was indexed), column names and the rows of each row group.
- A JSONL file `F` gets `F.bagel_index.json` (its identity and line count), `F.bagel_lines.npy` (the byte offset where each line starts, plus one
  past the last line: N + 1 int64, memory-mappable) and, for each `shuffle_seed`
  a config shuffles it with, `F.bagel_shuffle_SEED.npy` (upstream's line order).

Each data file is identified by its size and content checksums (`identity`), not
by its time: a copy, an upload or a bucket-to-bucket copy of the corpus keeps its
index valid; a file rewritten, even at its size, is refused by name. Integrity is checked
too, before any value is used: the parquet index carries a SHA-256 of its content,
and `F.bagel_index.json` a CRC-32 of every MiB of each `.npy` file beside it, so a
reader verifies just the blocks it reads (a host reading its share of a 10M-line
index checks its share). A damaged file is refused naming it. Indexes written
before these checksums (formats 1 and 2) are refused with "re-run `bagel-grain
index`": trusting them would let a zeroed shuffle repeat one line a whole epoch,
or a copy's new times refuse every file.
"""

from __future__ import annotations

import array
import concurrent.futures
import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import random
import zlib
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bagel_grain import fs, io_limits
from bagel_grain.errors import DatasetError
from bagel_grain.sources import identity, parquet_footer

log = logging.getLogger(__name__)

PARQUET_INDEX = ".bagel_index.arrow"
_PARQUET_FORMAT = b"bagel-grain parquet index 3"
_JSONL_FORMAT = "bagel-grain jsonl index 3"
_OLD_FORMATS = (b"bagel-grain parquet index 1", "bagel-grain jsonl index 1",
                b"bagel-grain parquet index 2", "bagel-grain jsonl index 2")
CHECK_BLOCK = 1 << 20  # bytes of a .npy sidecar per CRC-32
_SCAN_CHUNK = 1 << 24
_GATHER_CHUNK = 1 << 20  # boundaries read at a time when gathering a shard's lines
_WHOLE_READ_SHARE = 8  # a share of over 1/8 of the lines reads every boundary at once
# Without an index a build reads every footer / scans every line: worth a warning from
# about a second of start-up on (100 footers on an object store at 20 ms, 1M lines).
WARN_FILES = 100
WARN_LINES = 1_000_000
_warned: set[str] = set()  # paths warned about in this process: once each


def _warn_once(path: str, what: str) -> None:
  if path in _warned:
    return
  _warned.add(path)
  log.warning("%s: no sidecar index, so every start %s. Run `bagel-grain index CONFIG` once "
              "to skip this.", path, what)


def _rebuild_hint(what: str) -> str:
  return (f"{what}; run `bagel-grain index CONFIG` to rebuild the index, or delete it "
          "to scan the data at every start")


_OUTDATED = ("the sidecar index was written by an older bagel-grain (without the checksums that "
             "identify its files by content); re-run `bagel-grain index CONFIG`")


# -- parquet ---------------------------------------------------------------------


class ParquetFileFacts:
  """Per parquet file: its columns and the rows of each of its row groups."""

  def __init__(self, columns: Sequence[str], row_group_rows: np.ndarray,
               ident: identity.Identity | None = None):
    self.columns = tuple(columns)
    self.row_group_rows = np.asarray(row_group_rows, np.int64)
    self.identity = ident  # what the index recorded of the file; None from a footer

  @classmethod
  def of_footer(cls, meta: pq.FileMetaData) -> ParquetFileFacts:
    return cls(meta.schema.to_arrow_schema().names,
               [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])


def list_parquet_files(data_dir: str) -> list[tuple[str, identity.Identity]]:
  """(name, identity as listed) of each parquet file in the folder, by name: one listing."""
  infos = fs.list_file_infos(data_dir, ".parquet")
  if not infos:
    raise DatasetError("no .parquet files in data_dir", file=data_dir, field="data_dir")
  return [(i.base_name, identity.of_listing(i)) for i in infos]


_IDENTITY_FIELDS = ("size", "mtime_ns", "md5", "crc32c", "etag", "probe")


def _parquet_checksum(names, identities, columns, rows) -> bytes:
  """SHA-256 of an index's values, spelled independently of Arrow's file layout (so any
  pyarrow version writes and checks the same one)."""
  digest = hashlib.sha256()
  for name, ident, cols, counts in zip(names, identities, columns, rows, strict=True):
    digest.update(json.dumps([name, dataclasses.astuple(ident), list(cols)]).encode())
    digest.update(np.asarray(counts, "<i8").tobytes() + b"\n")
  return digest.hexdigest().encode()


def parquet_index_bytes(files: Sequence[tuple[str, identity.Identity]],
                        facts: Sequence[ParquetFileFacts]) -> bytes:
  """The folder's index file: (name, identity as `identity.indexed` gives it) of each
  file, and their facts."""
  names = [f[0] for f in files]
  identities = [f[1] for f in files]
  columns = [list(f.columns) for f in facts]
  rows = [f.row_group_rows for f in facts]
  table = pa.table({
      "name": names,
      **{field: pa.array([getattr(i, field) for i in identities],
                         pa.int64() if field in ("size", "mtime_ns") else pa.string())
         for field in _IDENTITY_FIELDS},
      "columns": pa.array(columns, pa.list_(pa.string())),
      "row_group_rows": pa.array(rows, pa.list_(pa.int64())),
  }).replace_schema_metadata({b"format": _PARQUET_FORMAT,
                              b"sha256": _parquet_checksum(names, identities, columns, rows)})
  out = io.BytesIO()
  with pa.ipc.new_file(out, table.schema) as writer:
    writer.write_table(table)
  return out.getvalue()


def indexed_parquet_file(path: str, listed: identity.Identity,
                         progress: Callable | None = None):
  """(identity, facts) of one parquet file, as its index records them."""
  return identity.indexed(path, listed, "parquet", progress), ParquetFileFacts.of_footer(
      parquet_footer.read(path, at_build=True))


def write_parquet_index(data_dir: str, progress: Callable | None = None) -> str:
  """Reads every parquet file of the folder once (its checksums, unless the listing gives
  them, and its footer); writes the folder's index. `progress(n)`: n bytes read."""
  files = list_parquet_files(data_dir)
  with concurrent.futures.ThreadPoolExecutor(io_limits.FOOTER_THREADS) as pool:
    done = list(pool.map(lambda f: indexed_parquet_file(fs.join(data_dir, f[0]), f[1], progress),
                         files))
  path = fs.join(data_dir, PARQUET_INDEX)
  fs.write_bytes(path, parquet_index_bytes([(name, d[0]) for (name, _), d in zip(files, done)],
                                           [d[1] for d in done]))
  return path


def _load_parquet_index(path: str):
  """(names, identities, columns, row group rows) of an index file, checked; FileNotFoundError
  when there is none."""
  try:
    with fs.open_random_access(path) as f:
      table = pa.ipc.open_file(f).read_all()
  except FileNotFoundError:
    raise
  except (OSError, pa.ArrowException) as e:
    raise DatasetError(_rebuild_hint(f"unreadable sidecar index: {e}"), file=path) from None
  metadata = table.schema.metadata or {}
  if metadata.get(b"format") in _OLD_FORMATS:
    raise DatasetError(_OUTDATED, file=path)
  if metadata.get(b"format") != _PARQUET_FORMAT:
    raise DatasetError(_rebuild_hint("not a bagel-grain parquet index"), file=path)
  try:
    names = table.column("name").to_pylist()
    fields = [table.column(f).to_pylist() for f in _IDENTITY_FIELDS]
    columns = table.column("columns").to_pylist()
    rows = [r.values.to_numpy() for r in table.column("row_group_rows")]
  except KeyError as e:
    raise DatasetError(_rebuild_hint(f"not a bagel-grain parquet index: {e}"), file=path) from None
  identities = [identity.Identity(*values) for values in zip(*fields)]
  if _parquet_checksum(names, identities, columns, rows) != metadata.get(b"sha256"):
    raise DatasetError(_rebuild_hint("the index does not match its checksum: it was damaged "
                                     "or edited after it was written"), file=path)
  return names, identities, columns, rows


def read_parquet_index(data_dir: str, listed: Sequence[fs.FileInfo], *,
                       present: bool = True) -> dict[str, ParquetFileFacts] | None:
  """The folder's index as {file path: facts}; None (and a warning) when there is none
  (`present=False`: the folder's listing shows none, so none is asked for: on a bucket a
  HEAD and a LIST before the first batch).

  DatasetError when a listed file is missing from the index, or is not the file indexed
  (`identity.compare`, then its probe when the listing cannot tell).
  """
  path = fs.join(data_dir, PARQUET_INDEX)
  try:
    if not present:
      raise FileNotFoundError(path)
    names, identities, columns, rows = _load_parquet_index(path)
  except FileNotFoundError:
    if len(listed) >= WARN_FILES:
      _warn_once(data_dir, f"reads the footers of its {len(listed):,} parquet files")
    return None
  by_name = dict(zip(names, identities))
  for info in listed:
    if info.base_name not in by_name:
      raise DatasetError(_rebuild_hint(f"the index does not know {info.base_name}, added "
                                       "since it was written"), file=path, field="data_dir")
  _check_files(path, [(fs.join(data_dir, i.base_name), by_name[i.base_name],
                       identity.of_listing(i)) for i in listed], "parquet")
  if len(listed) != len(names):
    gone = sorted(set(names) - {i.base_name for i in listed})
    raise DatasetError(_rebuild_hint(f"indexed files are gone: {gone[:3]}"), file=path,
                       field="data_dir")
  return {fs.join(data_dir, name): ParquetFileFacts(columns[i], rows[i], identities[i])
          for i, name in enumerate(names)}


def indexed_checksums(path: str, kind: str) -> dict[str, str]:
  """{file path: content checksum (`Identity.checksum`)} as the index of a parquet folder
  or a JSONL file records them; {} when there is no index. For a saved state's manifest:
  the build has checked the index against the files already."""
  try:
    if kind == "parquet":
      names, identities, _, _ = _load_parquet_index(fs.join(path, PARQUET_INDEX))
      return {fs.join(path, n): i.checksum() for n, i in zip(names, identities) if i.checksum()}
    meta_path = _jsonl_paths(path)[0]
    ident = _jsonl_identity(json.loads(fs.read_bytes(meta_path)), meta_path)
  except FileNotFoundError:
    return {}
  return {path: ident.checksum()} if ident.checksum() else {}


def _check_files(index_path: str, files, kind: str) -> None:
  """Refuses, naming it, a file (path, indexed, listed now) that is not the one indexed;
  a file the listing cannot tell (a copy's new time on local disk) is checked by its probe,
  and one warning per index says so and how to check them whole."""
  probed = []
  for path, indexed, now in files:
    same, why = identity.compare(indexed, now)
    if same is None:
      probed.append(path)
      same = identity.probe(path, kind) == indexed.probe
      why = "same size, but its " + ("footer" if kind == "parquet" else "first or last MiB") + (
          " differs from the indexed file's")
    if not same:
      raise DatasetError(_rebuild_hint(f"{os.path.basename(path)} changed since the index was "
                                       f"written ({why})"),
                         file=index_path, field="data_dir" if kind == "parquet" else "jsonl_path")
  if probed and index_path not in _warned:
    _warned.add(index_path)
    log.warning("%s: %d file(s) have other times than the index recorded (copied?), e.g. %s; "
                "checked by their %s only. `bagel-grain index CONFIG --verify` checks their "
                "whole content once and records their times.", index_path, len(probed),
                probed[0], "footers" if kind == "parquet" else "first and last MiB")


def read_parquet_info(path: str) -> dict[str, int]:
  """Upstream's `parquet_info` JSON as {parquet path as written: num_row_groups}."""
  try:
    raw = json.loads(fs.read_bytes(path))
  except (OSError, ValueError) as e:
    raise DatasetError(f"cannot read parquet_info: {e}", file=path,
                       field="parquet_info_path") from None
  counts = {}
  if isinstance(raw, dict):
    for key, entry in raw.items():
      n = entry.get("num_row_groups") if isinstance(entry, dict) else None
      if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        counts[key] = n
  if not isinstance(raw, dict) or len(counts) != len(raw):
    raise DatasetError("parquet_info must map each parquet path to {\"num_row_groups\": N}",
                       file=path, field="parquet_info_path")
  return counts


def row_group_counts(files: Sequence[str], info: dict[str, int]) -> dict[str, int]:
  """The parquet_info count of each file found in it, keyed by our path.

  A key names a file when it is the file's path, or its trailing part (a key
  written relative to some root, or on another machine): the longest match wins.
  """
  by_tail = {key.lstrip("./"): n for key, n in info.items()}
  by_tail.update(info)
  found = {}
  for path in set(files):
    parts = path.split("/")
    for i in range(len(parts)):  # longest tail first
      tail = "/".join(parts[i:])
      if tail in by_tail:
        found[path] = by_tail[tail]
        break
  return found


# -- JSONL -----------------------------------------------------------------------


def _jsonl_paths(path: str) -> tuple[str, str]:
  return path + ".bagel_index.json", path + ".bagel_lines.npy"


def shuffle_path(path: str, seed: int) -> str:
  return f"{path}.bagel_shuffle_{int(seed)}.npy"


def line_ends(path: str, start: int = 0, stop: int | None = None,
              progress: Callable | None = None) -> np.ndarray:
  """One past each `\\n` in bytes [start, stop) of the file, as int64: where the next
  line starts. A byte range of a huge file is scanned on its own (`bagel-grain index
  --runner` splits a file so); the ranges' results laid end to end are the whole file's."""
  pieces = [np.zeros(0, np.int64)]
  for position, chunk in _chunks(path, start, stop):
    pieces.append(_newline_ends(chunk, position))
    if progress:
      progress(len(chunk))
  return np.concatenate(pieces)


def _newline_ends(chunk: bytes, position: int) -> np.ndarray:
  """One past each `\\n` of `chunk`, the file's bytes from `position` on."""
  return np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10).astype(np.int64) + (position + 1)


def _chunks(path: str, start: int, stop: int | None):
  """(offset, bytes) of [start, stop) in pieces of `_SCAN_CHUNK`, by ranged reads (an
  object's each waits out transient faults: `storage.retried`)."""
  position = start
  while stop is None or position < stop:
    want = _SCAN_CHUNK if stop is None else min(_SCAN_CHUNK, stop - position)
    chunk = fs.read_range(path, position, want)
    if not chunk:
      return
    yield position, chunk
    position += len(chunk)


def line_starts_from_ends(ends: Sequence[np.ndarray], size: int) -> np.ndarray:
  """The N + 1 boundaries of `scan_line_starts` from the `line_ends` of a file's byte
  ranges, in order, and the file's size."""
  starts = np.concatenate([np.zeros(1, np.int64), *ends])
  if starts[-1] != size:  # a last line without a final newline
    starts = np.append(starts, size + 1)
  return starts


def scan_line_starts(path: str, progress: Callable | None = None,
                     size: int | None = None) -> np.ndarray:
  """N + 1 int64: where each of the N lines starts, then one past the last line's end.

  Line i is bytes [b[i], b[i + 1] - 1) (its `\\n` excluded), as upstream's
  `readlines()` splits them: a last line without a final newline counts, an
  empty tail after the final newline does not. Chunks are scanned by numpy; the
  offsets never pass through Python lists.
  """
  size = fs.file_info(path).size if size is None else size
  return line_starts_from_ends([line_ends(path, 0, size, progress)], size)


def upstream_line_order(n: int, seed: int) -> np.ndarray:
  """The line order upstream's `random.Random(seed).shuffle(lines)` makes, as int64.

  The same swaps, on an 8-byte-per-line array instead of a list of Python ints.
  """
  order = array.array("q")
  order.frombytes(np.arange(n, dtype=np.int64).tobytes())
  random.Random(seed).shuffle(order)
  return np.frombuffer(order, np.int64)


def _npy_bytes(values: np.ndarray) -> bytes:
  out = io.BytesIO()
  np.lib.format.write_array(out, np.ascontiguousarray(values), allow_pickle=False)
  return out.getvalue()


def block_checksums(data: bytes) -> list[int]:
  """CRC-32 of each `CHECK_BLOCK` bytes of a sidecar file, from its first byte."""
  view = memoryview(data)
  return [zlib.crc32(view[i:i + CHECK_BLOCK]) for i in range(0, len(data), CHECK_BLOCK)]


def jsonl_index_files(path: str, ident: identity.Identity, starts: np.ndarray,
                      shuffle_seeds: Sequence[int] = ()) -> dict[str, bytes]:
  """{sidecar path: content} for the JSONL file `path` of identity `ident`
  (`identity.indexed`) whose line boundaries are `starts`: line offsets, one shuffle per
  seed, and the identity with each file's checksums (written last, by `write_jsonl_files`)."""
  meta_path, lines_path = _jsonl_paths(path)
  files = {lines_path: _npy_bytes(starts.astype(np.int64))}
  seeds = sorted({int(s) for s in shuffle_seeds})
  for seed in seeds:
    order = upstream_line_order(len(starts) - 1, seed)
    files[shuffle_path(path, seed)] = _npy_bytes(
        order.astype(np.int32 if len(order) < 2**31 else np.int64))
  checksums = {_checksum_key(path, p): block_checksums(data) for p, data in files.items()}
  files[meta_path] = json.dumps({
      "format": _JSONL_FORMAT, **dataclasses.asdict(ident), "lines": len(starts) - 1,
      "shuffle_seeds": seeds, "check_block": CHECK_BLOCK, "crc32": checksums}).encode()
  return files


def _checksum_key(path: str, sidecar_path: str) -> str:
  """How the manifest names a sidecar file: its name after the JSONL file's."""
  return sidecar_path[len(path):].lstrip(".")


def write_jsonl_files(files: dict[str, bytes]) -> list[str]:
  """Writes `jsonl_index_files`' output, the stamp last: an index is whole once it is there."""
  meta = next(p for p in files if p.endswith(".bagel_index.json"))
  for p in [p for p in files if p != meta] + [meta]:
    fs.write_bytes(p, files[p])
  return [meta] + [p for p in files if p != meta]


def write_jsonl_index(path: str, shuffle_seeds: Sequence[int] = (),
                      progress: Callable | None = None) -> list[str]:
  """Scans the file once; writes its line offsets, its shuffles and, last, its stamp."""
  ident = identity.indexed(path, identity.of_listing(fs.file_info(path)), "jsonl")
  starts = scan_line_starts(path, progress)
  return write_jsonl_files(jsonl_index_files(path, ident, starts, shuffle_seeds))


class NpyRange:
  """Slices of a 1-D .npy file, read by range (local or remote): no whole-file load.

  With `crc32` (one per `CHECK_BLOCK` bytes of the file) every block a read touches
  is checked before its values are used; a mismatch is refused naming the file.
  """

  def __init__(self, path: str, crc32: Sequence[int] | None = None):
    self.path = path
    self._crc32 = None if crc32 is None else list(crc32)
    self._file = fs.open_random_access(path)
    try:
      size = self._file.size()
      if self._crc32 is not None and len(self._crc32) != -(-size // CHECK_BLOCK):
        raise DatasetError(_rebuild_hint(f"{size} bytes, but the index has checksums of "
                                         f"{len(self._crc32)} blocks"), file=path)
      head = io.BytesIO(self._read(0, min(size, CHECK_BLOCK)))
      version = np.lib.format.read_magic(head)
      read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                     else np.lib.format.read_array_header_2_0)
      shape, fortran, dtype = read_header(head)
    except ValueError as e:
      self._file.close()
      raise DatasetError(_rebuild_hint(f"not a .npy file: {e}"), file=path) from None
    except DatasetError:
      self._file.close()
      raise
    if len(shape) != 1 or fortran or dtype.hasobject:
      self._file.close()
      raise DatasetError(_rebuild_hint("not a 1-D array of numbers"), file=path)
    self.dtype, self.size, self._offset = dtype, shape[0], head.tell()

  def _read(self, offset: int, n: int) -> bytes:
    """Bytes [offset, offset + n) of the file, their blocks checked when there are checksums."""
    if self._crc32 is None or n <= 0:
      return self._file.read_at(n, offset)
    first, last = offset // CHECK_BLOCK, (offset + n - 1) // CHECK_BLOCK + 1
    data = self._file.read_at((last - first) * CHECK_BLOCK, first * CHECK_BLOCK)
    view = memoryview(data)
    for block in range(first, last):
      at = (block - first) * CHECK_BLOCK
      if block >= len(self._crc32) or zlib.crc32(view[at:at + CHECK_BLOCK]) != self._crc32[block]:
        raise DatasetError(_rebuild_hint(
            f"bytes {block * CHECK_BLOCK}-{(block + 1) * CHECK_BLOCK} do not match the index's "
            "checksum: the file was damaged or rewritten after indexing"), file=self.path)
    skip = offset - first * CHECK_BLOCK
    return bytes(view[skip:skip + n])

  def read(self, start: int, stop: int) -> np.ndarray:
    n = max(0, stop - start)
    data = self._read(self._offset + start * self.dtype.itemsize, n * self.dtype.itemsize)
    if len(data) != n * self.dtype.itemsize:
      raise DatasetError(_rebuild_hint("index file is truncated"), file=self.path)
    return np.frombuffer(data, self.dtype)

  def close(self) -> None:
    self._file.close()


def read_line_index_stamp(path: str) -> bytes:
  """The JSONL file `path`'s index stamp (`F.bagel_index.json`), unparsed; FileNotFoundError
  when there is none."""
  return fs.read_bytes(_jsonl_paths(path)[0])


class LineIndex:
  """Where the lines of one JSONL file are: from its sidecar when fresh, else by a scan.

  `info`: the file as the caller saw it (its `fs.FileInfo`), checked against the index
  and sizing a scan (else looked up); `stamp`: `read_line_index_stamp` of it, when the
  caller read it already (on a bucket, at the same time as `info`)."""

  def __init__(self, path: str, info: fs.FileInfo | None = None,
               stamp: Callable[[], bytes] | None = None, content: bytes | None = None):
    """`content`: the file's bytes, when the caller holds them (of `info`): a scan reads
    them instead of the file."""
    self.path = path
    self._lines: NpyRange | None = None
    self._starts: np.ndarray | None = None
    meta_path, lines_path = _jsonl_paths(path)
    try:
      meta = json.loads((stamp or functools.partial(read_line_index_stamp, path))())
    except FileNotFoundError:
      if content is not None:
        self._starts = line_starts_from_ends([_newline_ends(content, 0)], len(content))
      else:
        self._starts = scan_line_starts(path, size=None if info is None else info.size)
      self.count = len(self._starts) - 1
      if self.count >= WARN_LINES:
        _warn_once(path, f"scans its {self.count:,} lines for their offsets")
      return
    except (OSError, ValueError) as e:
      raise DatasetError(_rebuild_hint(f"unreadable sidecar index: {e}"), file=meta_path) from None
    if isinstance(meta, dict) and meta.get("format") in _OLD_FORMATS:
      raise DatasetError(_OUTDATED, file=meta_path)
    if (not isinstance(meta, dict) or meta.get("format") != _JSONL_FORMAT
        or meta.get("check_block") != CHECK_BLOCK or not isinstance(meta.get("crc32"), dict)):
      raise DatasetError(_rebuild_hint("not a bagel-grain JSONL index"), file=meta_path)
    self._crc32 = meta["crc32"]
    self.identity = _jsonl_identity(meta, meta_path)
    _check_files(meta_path, [(path, self.identity,
                              identity.of_listing(info or fs.file_info(path)))], "jsonl")
    self._lines = NpyRange(lines_path, self._checksums(lines_path))
    self.count = int(meta["lines"])
    if self._lines.size != self.count + 1:
      raise DatasetError(_rebuild_hint("line offsets do not match the line count"),
                         file=lines_path)

  identity: identity.Identity | None = None  # what the index recorded; None after a scan

  def _checksums(self, sidecar_path: str) -> list[int]:
    """The block checksums the manifest holds for one of its files; refused when none."""
    crc = self._crc32.get(_checksum_key(self.path, sidecar_path))
    if not isinstance(crc, list):
      raise DatasetError(_rebuild_hint(f"the index has no checksums for {sidecar_path}"),
                         file=_jsonl_paths(self.path)[0])
    return crc

  def order(self, seed: int, first: int, last: int) -> np.ndarray:
    """Positions [first, last) of upstream's shuffled line order (stored, or computed)."""
    stored = shuffle_path(self.path, seed)
    if self._lines is not None and fs.exists(stored):
      shuffle = NpyRange(stored, self._checksums(stored))
      try:
        if shuffle.size != self.count:
          raise DatasetError(_rebuild_hint("stored shuffle does not match the line count"),
                             file=stored)
        return shuffle.read(first, last).astype(np.int64)
      finally:
        shuffle.close()
    if self._lines is not None and self.count >= WARN_LINES:
      _warn_once(shuffle_path(self.path, seed), f"shuffles its {self.count:,} lines in Python "
                 f"(the index has no shuffle for seed {seed})")
    return upstream_line_order(self.count, seed)[first:last].copy()

  def spans(self, lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start offset, length without the newline) of each line number in `lines`."""
    lines = np.asarray(lines, np.int64)
    if self._starts is not None:
      starts, nexts = self._starts[lines], self._starts[lines + 1]
      return starts, nexts - 1 - starts
    if len(lines) and np.all(np.diff(lines) == 1):  # a contiguous run: one read
      bounds = self._lines.read(int(lines[0]), int(lines[-1]) + 2)
      return bounds[:-1].copy(), np.diff(bounds) - 1
    if len(lines) * _WHOLE_READ_SHARE >= self.count:  # most of the file: one read, no sort
      bounds = self._lines.read(0, self.count + 1)
      starts = bounds[lines]
      return starts, bounds[lines + 1] - 1 - starts
    starts, nexts = np.empty(len(lines), np.int64), np.empty(len(lines), np.int64)
    by_line = np.argsort(lines, kind="stable")
    wanted = lines[by_line]
    for chunk_start in range(0, self.count, _GATHER_CHUNK):
      lo, hi = np.searchsorted(wanted, [chunk_start, chunk_start + _GATHER_CHUNK])
      if lo == hi:
        continue
      bounds = self._lines.read(chunk_start, min(chunk_start + _GATHER_CHUNK, self.count) + 1)
      local = wanted[lo:hi] - chunk_start
      starts[by_line[lo:hi]] = bounds[local]
      nexts[by_line[lo:hi]] = bounds[local + 1]
    return starts, nexts - 1 - starts

  def close(self) -> None:
    if self._lines is not None:
      self._lines.close()


def _jsonl_identity(meta: dict, meta_path: str) -> identity.Identity:
  try:
    return identity.Identity(**{f.name: meta[f.name] for f in dataclasses.fields(identity.Identity)})
  except (KeyError, TypeError):
    raise DatasetError(_rebuild_hint("not a bagel-grain JSONL index"), file=meta_path) from None


# -- a whole config ----------------------------------------------------------------


def index_targets(cfg) -> tuple[list[str], dict[str, list[int]]]:
  """What `bagel-grain index` writes for a config: its parquet folders, and its JSONL files
  with the `shuffle_seed`s they are shuffled with. Converted (ArrayRecord) datasets need none."""
  parquet_dirs, jsonl_seeds = {}, {}
  for group in cfg.groups:
    for d in group.datasets:
      kind = group.family.record_format(d)
      if kind == "array_record":
        continue
      if kind == "jsonl":
        seeds = jsonl_seeds.setdefault(d.jsonl_path, set())
        if group.shuffle_lines:
          seeds.add(group.shuffle_seed)
      else:
        parquet_dirs[d.data_dir] = None
  return list(parquet_dirs), {path: sorted(seeds) for path, seeds in jsonl_seeds.items()}


def index_config(cfg, progress_factory: Callable) -> list[str]:
  """Writes the sidecar index of every parquet folder and JSONL file a config reads, in
  this process (`tooling/beam_index.py` writes the same files from a Beam pipeline).

  `progress_factory(total, unit, desc)` returns a progress bar (tqdm's interface:
  `update(n)`, `close()`). Returns the paths written.
  """
  parquet_dirs, jsonl_seeds = index_targets(cfg)
  written = []
  for data_dir in parquet_dirs:
    bar = progress_factory(sum(i.size for i in fs.list_file_infos(data_dir, ".parquet")), "B",
                           f"checksums and footers of {data_dir}")
    try:
      written.append(write_parquet_index(data_dir, bar.update))
    finally:
      bar.close()
  for path, seeds in jsonl_seeds.items():
    bar = progress_factory(fs.file_info(path).size, "B", f"lines of {path}")
    try:
      written.extend(write_jsonl_index(path, seeds, bar.update))
    finally:
      bar.close()
  return written


def verify_config(cfg, progress_factory: Callable) -> list[str]:
  """`bagel-grain index CONFIG --verify`: every indexed file whose listing cannot tell it
  from the file indexed (a local copy's new time, an S3 ETag of other parts) is read
  whole and its checksums compared with the index's; the index then records its time
  and ETag, so later builds trust it without reading. A file that differs is refused
  naming it; nothing is rewritten then. Returns the index files rewritten."""
  parquet_dirs, jsonl_seeds = index_targets(cfg)
  rewritten = []
  for data_dir in parquet_dirs:
    path = fs.join(data_dir, PARQUET_INDEX)
    names, identities, columns, rows = _load_parquet_index(path)
    listed = dict(list_parquet_files(data_dir))
    if sorted(listed) != sorted(names):
      raise DatasetError(_rebuild_hint("the folder's files are not the ones indexed"),
                         file=path, field="data_dir")
    updated = _verify_files(path, [(fs.join(data_dir, n), i, listed[n])
                                   for n, i in zip(names, identities)], progress_factory)
    if updated != identities:
      fs.write_bytes(path, parquet_index_bytes(
          list(zip(names, updated)), [ParquetFileFacts(c, r) for c, r in zip(columns, rows)]))
      rewritten.append(path)
  for jsonl in jsonl_seeds:
    meta_path = _jsonl_paths(jsonl)[0]
    meta = json.loads(fs.read_bytes(meta_path))
    indexed = _jsonl_identity(meta, meta_path)
    (updated,) = _verify_files(meta_path, [(jsonl, indexed, identity.of_listing(
        fs.file_info(jsonl)))], progress_factory)
    if updated != indexed:
      fs.write_bytes(meta_path, json.dumps({**meta, **dataclasses.asdict(updated)}).encode())
      rewritten.append(meta_path)
  return rewritten


def _verify_files(index_path: str, files, progress_factory: Callable) -> list[identity.Identity]:
  """The identities an index records after `verify_config` read the files (path, indexed,
  listed now) that need it."""
  unsure = [f for f in files if identity.compare(f[1], f[2])[0] is not True]
  bar = progress_factory(sum(f[2].size for f in unsure), "B", f"content of {index_path}")
  out = {}
  try:
    for path, indexed, now in unsure:
      same, updated = identity.verified(indexed, now, identity.content(path, bar.update))
      if not same:
        raise DatasetError(_rebuild_hint(f"{os.path.basename(path)} changed since the index "
                                         "was written (its content's checksums differ)"),
                           file=index_path)
      out[path] = updated
  finally:
    bar.close()
  return [out.get(path, indexed) for path, indexed, _ in files]
