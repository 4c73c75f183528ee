"""`bagel-grain audit --runner`: the report of the loader venv's in-process audit, on the
bad-data corpus whose drops are known. The DirectRunner runs in this process here (the
index and convert tests run it on worker processes): tasks of 16 records still merge
from many bundles."""

import json
import subprocess

import yaml

from beam_helpers import beam_cli
from test_bad_data import CONFIGS, MAX_DECODE, corpus  # pylint: disable=unused-import

IN_PROCESS = """
import json, sys
from bagel_grain.config import load_config
from bagel_grain.tokenizer import load_tokenizer
from bagel_grain.tooling import audit
cfg = load_config(sys.argv[1])
merged = audit.audit_in_process(cfg, load_tokenizer(cfg.tokenizer_path))
print(json.dumps(audit.build_report(cfg, merged, sample=None, epoch_sizes=audit.epoch_sizes(cfg))))
"""


def test_the_runner_reports_what_the_loader_venv_reports(corpus, demo_dir, tmp_path,
                                                          loader_python):
  raw = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
  raw.update(dataset_info=corpus.dataset_info, tokenizer_path=str(demo_dir / "tokenizer"),
             max_decode_pixels=MAX_DECODE)
  config = tmp_path / "bad.yaml"
  config.write_text(yaml.safe_dump(raw))
  out = beam_cli("audit", "--config", str(config), "--out", str(tmp_path / "audit"),
                 "--task-elements", "16", "--runner", "DirectRunner")
  report = json.loads((tmp_path / "audit.json").read_text())
  assert (tmp_path / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  loader = subprocess.run([loader_python, "-c", IN_PROCESS, str(config)], capture_output=True,
                          text=True, timeout=300, check=True)
  assert report == json.loads(loader.stdout)
  for group, expected in corpus.expected_drops.items():
    drops = report["groups"][group]["drops"]
    assert {r: d["count"] for r, d in drops.items()} == dict(expected), group
    for reason, d in drops.items():
      assert f"{reason}: {d['count']} (e.g. {d['examples'][0]})" in out
