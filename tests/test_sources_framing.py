"""The byte framing of a converted record: round trips, refusals, damaged bytes."""

import json
import struct

import pytest

from bagel_grain.sources import framing
from bagel_grain.sources.framing import FramingError, LineWithFiles


def test_framing_round_trips_rows_and_lines():
  row = {"image": b"\x89PNG\x00\xff", "captions": '{"a": "caf\u00e9"}', "n": 3, "x": None,
         "image_list": [b"one", b"", b"three"], "instruction_list": [["a", "b"], ["c"]]}
  data = framing.encode(row, origin="f.parquet#7")
  assert data[:4] == b"BGR1"
  (header_length,) = struct.unpack_from("<I", data, 4)
  header = json.loads(data[8:8 + header_length])  # readable without this package
  assert header["origin"] == "f.parquet#7" and header["fields"]["image"] is None
  assert header["blobs"][0] == [["image"], 6]
  assert framing.decode(data) == (framing.PARQUET_ROW, row)

  line = LineWithFiles(b'{"image": "a.png"} \xff', {"a.png": b"png", "clip/f_1.jpg": b"j"},
                       {"link.png": "path_outside_data_dir"})
  assert framing.decode(framing.encode(line)) == (framing.JSONL_LINE, line)


def test_framing_refuses_what_json_cannot_hold():
  with pytest.raises(TypeError):
    framing.encode({"when": object()})
  with pytest.raises(TypeError):
    framing.encode({"m": {1: "x"}})


GOOD = framing.encode({"image": b"abc" * 10, "captions": "{}"})


@pytest.mark.parametrize("data", [
  b"", GOOD[:3], GOOD[:8], GOOD[:20], GOOD[:-1], GOOD + b"x", b"XXXX" + GOOD[4:],
  GOOD[:4] + struct.pack("<I", 10**6) + GOOD[8:],
  GOOD[:8] + b"{" * (len(GOOD) - 8),
  framing.encode({"a": None})[:-2] + b"]]",  # header JSON cut
  framing.encode({"a": [None]}).replace(b'"blobs":[]', b'"blobs":[[["a",5],0]]'),
  framing.encode({"a": "x"}).replace(b'"blobs":[]', b'"blobs":[[["a"],0]]'),
  framing.encode({"a": 1}).replace(b'"parquet_row"', b'"pickle"'),
  framing.encode(LineWithFiles(b"x")).replace(b'"files":{}', b'"files":[]'),
  # a file's verdict that is no drop reason, or not a string at all
  framing.encode(LineWithFiles(b"x", {}, {"a.png": "missing_file"})).replace(
      b'"missing_file"', b'"disk_on_fire"'),
  framing.encode(LineWithFiles(b"x", {}, {"a.png": "missing_file"})).replace(
      b'"missing_file"', b'["missing_file"]'),
], ids=range(16))
def test_framing_rejects_damaged_records(data):
  with pytest.raises(FramingError):
    framing.decode(data)
