"""Beam stays out of the loader: importing and running it in the Beam venv loads no Beam."""

import subprocess
import sys

from beam_helpers import demo_copy

LOADER = """
import sys
from bagel_grain.configs import load_shipped
from bagel_grain.pipeline import build_pipeline
from bagel_grain.tokenizer import load_tokenizer
from bagel_grain.tooling import audit, cli, convert
cfg = load_shipped("demo", sys.argv[1])
it = iter(build_pipeline(cfg, load_tokenizer(cfg.tokenizer_path), batch_size=1, workers=0))
next(it)
it.close()
assert cli.main(["index", sys.argv[1] + "/../config.yaml"]) == 0
print(sorted(m for m in sys.modules if m.startswith("apache_beam")))
"""


def test_the_loader_and_the_in_process_commands_import_no_beam(demo_dir, tmp_path):
  demo_copy(demo_dir, tmp_path)
  done = subprocess.run([sys.executable, "-c", LOADER, str(tmp_path / "data")],
                        capture_output=True, text=True, timeout=300, check=True)
  assert done.stdout.splitlines()[-1] == "[]"
