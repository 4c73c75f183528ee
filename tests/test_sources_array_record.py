"""ArrayRecord files as a record source: record counts from footers, damaged records dropped."""

import pickle
import time

import numpy as np
import pytest
from array_record.python import array_record_module

from bagel_grain.errors import DatasetError
from bagel_grain.families.t2i import T2ITransform
from bagel_grain.images import ImageTransform
from bagel_grain.sample import Sample
from bagel_grain.sources import framing
from bagel_grain.sources.array_record import ArrayRecordSource, array_record_files
from bagel_grain.sources.records import ConcatSource, ShuffledRecords
from vlm_files import png

GOOD = framing.encode({"image": b"abc" * 10, "captions": "{}"})


def write_array_record(path, records):
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for record in records:
    writer.write(record)
  writer.close()
  return str(path)


def test_a_damaged_record_is_dropped_with_its_reason(tmp_path, demo_tokenizer):
  good = framing.encode({"image": png(), "captions": '{"a": "a red square"}'})
  path = write_array_record(tmp_path / "x.array_record", [good, good[:-5], b"junk", good])
  source = ArrayRecordSource([path])
  records = ShuffledRecords(ConcatSource([source]), seed=0, num_epochs=1)
  t2i = T2ITransform(vae_transform=ImageTransform(max_image_size=64, min_image_size=32,
                                                  image_stride=16),
                     group=0, tokenizer=demo_tokenizer, max_decode_pixels=10**7)
  outcomes = {r.record_id: t2i.random_map(r, np.random.default_rng(0))
              for r in (records[i] for i in range(len(records)))}
  assert sorted(outcomes) == [f"{path}:{i}" for i in range(4)]
  assert isinstance(outcomes[f"{path}:0"], Sample) and isinstance(outcomes[f"{path}:3"], Sample)
  for i in (1, 2):
    assert outcomes[f"{path}:{i}"].reason == "corrupt_record"
    assert outcomes[f"{path}:{i}"].detail  # says what is wrong


def test_a_truncated_file_is_a_build_error(tmp_path):
  path = write_array_record(tmp_path / "x.array_record", [GOOD] * 3)
  data = open(path, "rb").read()
  open(path, "wb").write(data[:len(data) // 2])
  with pytest.raises(DatasetError, match="truncated"):
    ArrayRecordSource([path])


def test_files_of_a_folder_read_as_one_source_that_pickles(tmp_path):
  rows = [{"id": f"r{i}", "image": bytes([i]) * 5} for i in range(7)]
  write_array_record(tmp_path / "b.array_record", [framing.encode(r) for r in rows[4:]])
  write_array_record(tmp_path / "a.array_record", [framing.encode(r) for r in rows[:4]])
  (tmp_path / "notes.txt").write_text("not a shard")
  files = array_record_files(str(tmp_path))
  assert [f.rsplit("/", 1)[1] for f in files] == ["a.array_record", "b.array_record"]
  source = ArrayRecordSource(files)
  assert [source[i] for i in range(len(source))] == rows
  assert source.record_id(5) == f"{files[1]}:1"
  copy = pickle.loads(pickle.dumps(source))  # workers get the source by pickle
  assert [copy[i] for i in range(len(copy))] == rows
  with pytest.raises(IndexError):
    source[7]


def _sized(n: int, fill: int) -> bytes:
  return framing.encode({"image": bytes([fill]) * n, "captions": "{}"})


def test_record_sizes_are_read_from_the_footer_before_the_records(tmp_path):
  # Records crossing 64 KiB block boundaries, and a footer of 3,000 chunks spanning blocks.
  records = [_sized(n, i % 251) for i, n in enumerate([10, 70_000, 5, 200_000] + [40] * 3000)]
  converted = tmp_path / "converted"
  converted.mkdir()
  writer = array_record_module.ArrayRecordWriter(str(converted / "a.array_record"),
                                                 "group_size:1,uncompressed")
  for record in records:
    writer.write(record)
  writer.close()
  write_array_record(converted / "b.array_record", [GOOD] * 3)  # compressed: no sizes here
  source = ArrayRecordSource(array_record_files(str(converted)))
  assert [source.record_bytes(i) for i in range(len(records))] == [len(r) for r in records]
  assert [source.record_bytes(len(records) + i) for i in range(3)] == [None] * 3
  part = pickle.loads(pickle.dumps(source.restrict(1, 4)))
  assert [part.record_bytes(i) for i in range(3)] == [len(r) for r in records[1:4]]


def test_a_huge_record_is_read_ahead_alone(tmp_path):
  """With its size known, read-ahead starts a record larger than its bound only when
  nothing else is held, not beside guesses of the small records' size."""
  import threading

  import grain

  from bagel_grain.sources import readahead
  from bagel_grain.sources.readahead import ReadAhead, ReadAheadRecords

  sizes = [100, 100, 3 << 20, 100, 3 << 20, 100]
  path = tmp_path / "a.array_record"
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1,uncompressed")
  for i, n in enumerate(sizes):
    writer.write(_sized(n, i))
  writer.close()
  source = ArrayRecordSource([str(path)])
  gate, started = threading.Event(), []

  class Gated(grain.MapDataset):
    """The source's records; reads wait for the gate (none ends while the test looks)."""

    def __init__(self):
      super().__init__()

    def __len__(self):
      return len(source)

    def __getitem__(self, index):
      started.append(index)
      if index:
        gate.wait(30)
      return source[index]

    def record_bytes(self, index):
      return source.record_bytes(index)

  ahead = ReadAhead(max_bytes=1 << 20)
  old_share = readahead._SHARE  # pylint: disable=protected-access
  readahead.set_share((0, 1))
  try:
    ra = ReadAheadRecords(Gated(), files_of=lambda r: [], read_file=None, ahead=ahead, depth=5)
    ra[0]
    deadline = time.monotonic() + 30  # the read-ahead thread starts record 1 when it runs
    while len(started) < 2 and time.monotonic() < deadline:
      time.sleep(0.01)
    time.sleep(0.2)  # time enough for record 2 to start, were it admitted beside record 1
    assert started == [0, 1]  # record 2 (3 MiB) waits until record 1 is taken
    gate.set()
    for i in range(1, len(sizes)):
      assert ra[i]["image"] == bytes([i]) * sizes[i]
  finally:
    gate.set()
    ahead.close()
    readahead.set_share(old_share)


@pytest.mark.parametrize("tail", [b"", b"\xff" * 64, bytes(range(256)) * 4])
def test_a_footer_it_cannot_read_gives_no_sizes(tmp_path, tail):
  from bagel_grain.sources.array_record_sizes import BLOCK, record_sizes
  path = tmp_path / "f.array_record"
  path.write_bytes(b"\x00" * (2 * BLOCK - len(tail)) + tail)  # no postscript where it belongs
  assert record_sizes(str(path), 3) is None
  path.write_bytes(b"\x00" * 100)  # shorter than a block
  assert record_sizes(str(path), 3) is None
