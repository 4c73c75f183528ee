"""`bagel-grain index --runner`: the same sidecar bytes as the loader venv's in-process index."""

import dataclasses

import numpy as np

from bagel_grain import fs
from bagel_grain.config import load_config
from bagel_grain.sources import identity, parquet_footer, sidecar
from bagel_grain.tooling import beam_index
from beam_helpers import MULTI, beam_cli, demo_copy

SIDECARS = ("t2i/.bagel_index.arrow", "edit/.bagel_index.arrow",
            "vlm/sft.jsonl.bagel_index.json", "vlm/sft.jsonl.bagel_lines.npy",
            "vlm/sft.jsonl.bagel_shuffle_0.npy")


def _sidecars(data):
  return {name: (data / name).read_bytes() for name in SIDECARS}


def test_two_workers_and_byte_ranges_write_the_loader_venvs_bytes(demo_dir, tmp_path,
                                                                    loader_cli):
  config = demo_copy(demo_dir, tmp_path)
  data = tmp_path / "data"
  for name in SIDECARS:
    (data / name).unlink(missing_ok=True)
  loader_cli("index", str(config))  # in process, pyarrow 26, pillow 13
  in_process = _sidecars(data)
  for name in SIDECARS:
    (data / name).unlink(missing_ok=True)
  size = (data / "vlm" / "sft.jsonl").stat().st_size
  # Ranges of 999 bytes cut lines anywhere: the file is scanned in about 10 pieces.
  out = beam_cli("index", str(config), "--runner", "DirectRunner", "--split-bytes", "999",
                 *MULTI)
  assert size > 5 * 999
  assert _sidecars(data) == in_process
  assert out.count("wrote ") == len(SIDECARS)


def test_byte_ranges_assemble_the_lines_of_a_file_without_a_final_newline(tmp_path):
  path = tmp_path / "f.jsonl"
  path.write_bytes(b'{"a": 1}\n\n{"b": 22}\r\n{"c": 333}')  # an empty line, CRLF, no final \n
  pieces = []
  for item in beam_index.jsonl_ranges((str(path), [0]), 4):
    pieces.append(beam_index.range_line_ends(item)[1])
  starts = sidecar.line_starts_from_ends([p[3] for p in pieces], path.stat().st_size)
  assert starts.tolist() == sidecar.scan_line_starts(str(path)).tolist() == [0, 9, 10, 21, 32]
  assert len(pieces) == 8 and np.all(np.diff([p[2] for p in pieces]) == 4)


def test_remote_data_is_indexed_in_its_bucket(demo_dir, tmp_path, monkeypatch):
  from object_store import LocalObjectStore  # the tests' local S3 and GCS servers
  config = demo_copy(demo_dir, tmp_path)
  with LocalObjectStore("s3") as store:
    for name, value in store.environment().items():
      monkeypatch.setenv(name, value)
    root = store.upload(str(tmp_path / "data"), "demo")
    text = config.read_text().replace(str(tmp_path / "data"), root)
    remote = tmp_path / "remote.yaml"
    remote.write_text(text)
    cfg = load_config(remote)
    monkeypatch.setattr(beam_index, "FILES_PER_TASK", 1)  # a footer per work item
    written = beam_index.run_index(cfg, "DirectRunner", split_bytes=999)
    assert all(p.startswith(root) for p in written)
    for folder in ("t2i", "edit"):  # the same index as the local copy's, files in name order
      local = tmp_path / "data" / folder
      assert fs.read_bytes(f"{root}/{folder}/{sidecar.PARQUET_INDEX}") == _with_stamps_of(
          local, f"{root}/{folder}")
    # Fresh for the bucket's objects: the loader builds from it without a scan.
    from bagel_grain.sources.jsonl import JsonlLineSource
    monkeypatch.setattr(sidecar, "scan_line_starts", _no_scan)
    source = JsonlLineSource(f"{root}/vlm/sft.jsonl", shuffle_lines=True, shuffle_seed=0)
    assert len(source) == len((tmp_path / "data/vlm/sft.jsonl").read_bytes().splitlines())


def _with_stamps_of(local, remote) -> bytes:
  """The local folder's index as written in the bucket: each file known by what the
  bucket's listing reports (size, time, ETag: nothing read) and its probe."""
  files = []
  for info in fs.list_file_infos(remote, ".parquet"):
    probe = identity.probe(str(local / info.base_name), "parquet")
    files.append((info.base_name, dataclasses.replace(identity.of_listing(info), probe=probe)))
  facts = [sidecar.ParquetFileFacts.of_footer(parquet_footer.read(str(local / f[0]), at_build=True))
           for f in files]
  return sidecar.parquet_index_bytes(files, facts)


def _no_scan(path, progress=None):
  raise AssertionError(f"{path} scanned")
