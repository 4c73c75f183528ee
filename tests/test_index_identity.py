"""An index knows its files by content: a copy with new times is accepted, a rewrite is not."""

import logging
import os
import pickle
import shutil

import pytest
import yaml

from bagel_grain import fs
from bagel_grain.drops import Drop, DropReason
from bagel_grain.errors import DatasetError
from bagel_grain.sources import identity, sidecar
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.parquet import dataset_source
from bagel_grain.sources.records import ConcatSource, ShuffledRecords
from bagel_grain.tooling import cli
from parquet_files import write_parquet


def _corpus(root):
  """A parquet folder of 3 files and a JSONL file of 40 lines, indexed."""
  folder = root / "pq"
  folder.mkdir(parents=True)
  for f in range(3):
    write_parquet(folder / f"part-{f}.parquet",
                  [[f"{f}:{g}:{r}" for r in range(2 + g)] for g in range(3)])
  lines = root / "rows.jsonl"
  lines.write_bytes(b"".join(f'{{"n": {i:03d}}}\n'.encode() for i in range(40)))
  sidecar.write_parquet_index(str(folder))
  sidecar.write_jsonl_index(str(lines), [3])
  return str(folder), str(lines)


def _records(source):
  records = ShuffledRecords(ConcatSource([source]), seed=5)
  return [(r.record_id.rsplit("/", 1)[1], r.fields)
          for r in (records[i] for i in range(records.records_per_epoch))]


def _read(folder, lines):
  return (_records(dataset_source(folder, None, ["id"])),
          _records(JsonlLineSource(lines, shuffle_lines=True, shuffle_seed=3)))


def _copy(src, dst):
  """`cp -r` without `-p`: the same bytes, every file with a new time."""
  shutil.copytree(src, dst, copy_function=shutil.copyfile)


_IMAGES = {"image_stride": 16, "max_image_size": 512, "min_image_size": 256}


def _config(tmp_path, folder, lines, tokenizer) -> str:
  path = tmp_path / "c.yaml"
  info = tmp_path / "info.yaml"
  info.write_text(yaml.safe_dump({"t2i_pretrain": {"d": {"data_dir": folder}},
                                  "vlm_sft": {"v": {"data_dir": os.path.dirname(lines),
                                                    "jsonl_path": lines}}}))
  path.write_text(yaml.safe_dump({
      "dataset_info": str(info), "tokenizer_path": str(tokenizer),
      "grouped_datasets": {
          "t2i_pretrain": {"dataset_names": ["d"], "image_transform_args": _IMAGES},
          "vlm_sft": {"dataset_names": ["v"], "shuffle_lines": True, "shuffle_seed": 3,
                      "image_transform_args": {**_IMAGES, "image_stride": 14}}}}))
  return str(path)


@pytest.mark.parametrize("how", ["cp -r", "touched"])
def test_an_index_is_accepted_after_a_copy_or_new_times_and_gives_the_same_records(
    tmp_path, how, caplog):
  folder, lines = _corpus(tmp_path / "a")
  expected = _read(folder, lines)
  if how == "cp -r":
    _copy(tmp_path / "a", tmp_path / "b")
    folder, lines = str(tmp_path / "b" / "pq"), str(tmp_path / "b" / "rows.jsonl")
  else:  # a mount or a restore that shows other times, every file's content the same
    for root, _, names in os.walk(tmp_path / "a"):
      for name in names:
        os.utime(os.path.join(root, name), ns=(1, 1_000_000_000))
  with caplog.at_level(logging.WARNING):
    assert _read(folder, lines) == expected
  assert "--verify" in caplog.text and "checked by their footers only" in caplog.text


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_copy_whose_file_was_rewritten_at_the_same_size_is_refused_by_name(tmp_path, kind):
  folder, lines = _corpus(tmp_path / "a")
  _copy(tmp_path / "a", tmp_path / "b")
  folder, lines = str(tmp_path / "b" / "pq"), str(tmp_path / "b" / "rows.jsonl")
  if kind == "parquet":
    target = os.path.join(folder, "part-1.parquet")
    size = os.path.getsize(target)
    write_parquet(target, [[f"7:{g}:{r}" for r in range(2 + g)] for g in range(3)])
  else:
    target = lines
    size = os.path.getsize(target)
    data = open(target, "rb").read()
    open(target, "wb").write(data.replace(b'"n": 017', b'"n": 071'))
  assert os.path.getsize(target) == size
  with pytest.raises(DatasetError, match=rf"{os.path.basename(target)} changed since the index "
                     "was written \\(same size, but its"):
    _read(folder, lines)


def test_verify_reads_a_copy_once_then_builds_trust_its_times(tmp_path, monkeypatch, capsys,
                                                             demo_dir):
  folder, lines = _corpus(tmp_path / "a")
  _copy(tmp_path / "a", tmp_path / "b")
  folder, lines = str(tmp_path / "b" / "pq"), str(tmp_path / "b" / "rows.jsonl")
  config = _config(tmp_path, folder, lines, demo_dir / "tokenizer")
  assert cli.main(["index", config, "--verify"]) == 0
  assert capsys.readouterr().out.count("it records their times now") == 2
  monkeypatch.setattr(identity, "probe", _no_probe)  # times agree now: nothing read
  expected = _read(folder, lines)
  assert cli.main(["index", config, "--verify"]) == 0
  assert "every file was known by its listing already" in capsys.readouterr().out
  assert _read(folder, lines) == expected


def _no_probe(path, kind):
  raise AssertionError(f"{path} probed")


def test_verify_sees_an_edit_a_probe_cannot_see_and_refuses_it_by_name(tmp_path, demo_dir,
                                                                       capsys):
  # A JSONL file over 2 MiB edited in its middle, line lengths kept: its first and last
  # MiB are unchanged, so a build's probe accepts it; --verify reads it whole.
  root = tmp_path / "a"
  folder, _ = _corpus(root)
  lines = root / "big.jsonl"
  lines.write_bytes(b"".join(f'{{"n": {i:07d}}}\n'.encode() for i in range(200_000)))
  sidecar.write_jsonl_index(str(lines))
  _copy(root, tmp_path / "b")
  copied = tmp_path / "b" / "big.jsonl"
  data = copied.read_bytes()
  copied.write_bytes(data.replace(b'"n": 0100000', b'"n": 0999999'))
  assert len(JsonlLineSource(str(copied))) == 200_000  # the probe cannot tell
  config = _config(tmp_path, str(tmp_path / "b" / "pq"), str(copied), demo_dir / "tokenizer")
  assert cli.main(["index", config, "--verify"]) == 1
  assert ("big.jsonl changed since the index was written (its content's checksums differ)"
          in capsys.readouterr().err)


def test_an_upload_style_identity_compares_by_checksum_not_time(tmp_path):
  folder, _ = _corpus(tmp_path / "a")
  path = os.path.join(folder, "part-0.parquet")
  indexed = identity.indexed(path, identity.of_listing(_info(path)), "parquet")
  size = os.path.getsize(path)
  # What GCS lists after an upload (crc32c, a new time), and S3 (single-part ETag = MD5).
  def listed(**reported):
    return identity.of_listing(fs.FileInfo("s3://b/k", "file", size, 5, **reported))

  assert identity.compare(indexed, listed(crc32c=indexed.crc32c.upper()))[0] is True
  assert identity.compare(indexed, listed(etag=indexed.md5, md5=indexed.md5))[0] is True
  assert identity.compare(indexed, listed(crc32c="00000000"))[0] is False
  assert identity.compare(indexed, listed(etag="0" * 32 + "-3"))[0] is None  # other parts


def test_the_multipart_etag_of_8_mib_parts_is_what_s3_reports_for_such_an_upload(tmp_path):
  import hashlib  # pylint: disable=import-outside-toplevel
  path = tmp_path / "big.bin"
  data = os.urandom(identity.S3_PART_BYTES * 2 + 5)
  path.write_bytes(data)
  parts = [data[i:i + identity.S3_PART_BYTES]
           for i in range(0, len(data), identity.S3_PART_BYTES)]
  expected = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
  got = identity.content(str(path))
  assert got.etag == f"{expected}-3" and got.md5 == hashlib.md5(data).hexdigest()


def _info(path):
  return fs.file_info(path)


def test_verify_compares_an_index_that_knew_only_an_s3_multipart_etag(tmp_path):
  path = tmp_path / "f.bin"
  path.write_bytes(b"abc" * 1000)
  read = identity.content(str(path))
  etag_only = identity.Identity(read.size, 1, etag=next(iter(read.multipart_etags())))
  same, updated = identity.verified(etag_only, identity.Identity(read.size, 2), read)
  assert same and updated.md5 == read.md5 and updated.mtime_ns == 2
  other = identity.Identity(read.size, 1, etag="0" * 32 + "-1")
  assert not identity.verified(other, identity.Identity(read.size, 2), read)[0]
  assert not identity.verified(identity.Identity(read.size), identity.Identity(read.size), read)[0]


# --- a file whose time changes mid-run: its content decides, in every process -----------


def _mid_run_corpus(tmp_path, kind, indexed):
  """(build a source of one file, that file, its records read in source order)."""
  folder = tmp_path / "pq"
  folder.mkdir()
  path = write_parquet(folder / "part-0.parquet", [[f"0:{g}:{r}" for r in range(3)]
                                                   for g in range(3)])
  lines = tmp_path / "rows.jsonl"
  lines.write_bytes(b"".join(f'{{"n": {i:03d}}}\n'.encode() for i in range(30)))
  if indexed:
    sidecar.write_parquet_index(str(folder))
    sidecar.write_jsonl_index(str(lines))
  if kind == "parquet":
    return (lambda: dataset_source(str(folder), None, ["id"])), path, 9
  return (lambda: JsonlLineSource(str(lines))), str(lines), 30


def _new_time(path):
  st = os.stat(path)
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
@pytest.mark.parametrize("indexed", [True, False])
def test_an_identical_file_with_a_new_time_mid_run_loses_nothing_in_any_process(
    tmp_path, monkeypatch, kind, indexed):
  build, path, count = _mid_run_corpus(tmp_path, kind, indexed)
  main = build()
  worker = pickle.loads(pickle.dumps(main))  # what a worker gets: opens the file afresh
  expected = [main[i] for i in range(count)]  # the main process has the file open
  data = open(path, "rb").read()
  open(path, "wb").write(data)  # uploaded again (through a mount): same bytes, a new time
  _new_time(path)
  probes = []
  real = fs.probe
  monkeypatch.setattr(fs, "probe", lambda *a: probes.append(a) or real(*a))
  for process in (main, worker):
    assert [process[i] for i in range(count)] == expected
  assert len(probes) == 1  # once per file and new time, not once per read


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
@pytest.mark.parametrize("indexed", [True, False])
def test_a_same_size_rewrite_mid_run_drops_the_file_in_every_process(tmp_path, kind, indexed):
  build, path, _ = _mid_run_corpus(tmp_path, kind, indexed)
  main = build()
  worker = pickle.loads(pickle.dumps(main))
  assert main[0]
  size = os.path.getsize(path)
  if kind == "parquet":
    write_parquet(path, [[f"7:{g}:{r}" for r in range(3)] for g in range(3)])
  else:
    data = open(path, "rb").read()
    open(path, "wb").write(data.replace(b'"n": 017', b'"n": 071'))
  assert os.path.getsize(path) == size
  _new_time(path)
  for process in (main, worker):
    with pytest.raises(Drop, match=rf"{os.path.basename(path)} changed since the stream was "
                       "built") as e:
      process[4]
    assert e.value.reason == DropReason.UNREADABLE_FILE
