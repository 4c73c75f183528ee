"""The stream's identity is computed on a thread (the first batch does not wait for it):
its failure still stops the stream at once, not at a checkpoint save hours later."""

import time

import pytest

from bagel_grain import pipeline
from bagel_grain.errors import DatasetError


def test_a_failed_identity_is_the_next_batches_error_not_a_later_save_s(
    demo_config, demo_tokenizer, monkeypatch):
  def failing(*args, **kwargs):
    raise DatasetError("demo.jsonl: changed while its manifest was read")

  monkeypatch.setattr(pipeline, "stream_identity", failing)
  it = iter(pipeline.build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0))
  try:
    for _ in range(200):  # batches until the thread's failure is known, then it is said
      try:
        next(it)
      except DatasetError as e:
        assert "changed while its manifest was read" in str(e)
        break
      time.sleep(0.05)
    else:
      pytest.fail("the identity's failure never stopped the stream")
    with pytest.raises(DatasetError, match="changed while its manifest was read"):
      next(it)  # and again: it does not go on without it
    with pytest.raises(DatasetError, match="changed while its manifest was read"):
      it.get_state()
  finally:
    it.close()
