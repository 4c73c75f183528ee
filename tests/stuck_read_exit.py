"""A process whose reads are stuck on a silent store: `python stuck_read_exit.py DEMO ROOT`.

The environment points at a fault proxy that sends every image at 3 bytes a second.
One `next()` runs on a daemon thread (its reads stuck, with a storage deadline of
minutes); the main thread then closes the iterator and returns. It prints
"closed" after close, and its exit must not wait for the stuck reads.
"""

import sys
import threading
import time
from pathlib import Path

from bagel_grain.config import config_from_dict
from bagel_grain.pipeline import build_pipeline
from bagel_grain.tokenizer import load_tokenizer
from conftest import CONFIGS
from shipped_demo import shipped_demo_raw


def main(demo_dir: str, root: str) -> None:
  raw = shipped_demo_raw(Path(demo_dir), root)
  raw.update(num_epochs=1, storage_timeout_s=300, element_timeout_s=400)
  cfg = config_from_dict(raw, file="remote.yaml", base_dir=str(CONFIGS))
  tokenizer = load_tokenizer(f"{demo_dir}/tokenizer/tokenizer.json")
  it = iter(build_pipeline(cfg, tokenizer, batch_size=2, workers=0))
  threading.Thread(target=lambda: next(it), daemon=True).start()
  time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 2.0)  # its reads are in flight now
  names = sorted(t.name for t in threading.enumerate() if "readahead" in t.name)
  print(f"reading ahead on {len(names)} threads", flush=True)
  it.close()
  print("closed", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
