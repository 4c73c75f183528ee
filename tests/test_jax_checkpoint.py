"""Orbax checkpoints of the data iterator: a damaged one names its file."""

import jax.numpy as jnp
import pytest

from bagel_grain import build_pipeline
from bagel_grain.errors import StateMismatchError
from bagel_grain.jax import checkpoint_manager, restore, save


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"version": 1}'])
def test_a_damaged_data_state_names_the_checkpoint_file(demo_config, demo_tokenizer, tmp_path,
                                                        damage):
  manager = checkpoint_manager(str(tmp_path / "checkpoints"))
  with iter(build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0)) as it:
    next(it)
    save(manager, 1, {"w": jnp.zeros(3)}, it)
  [data] = (tmp_path / "checkpoints" / "1" / "data").glob("shard_state_*.json")  # the one shard
  data.write_text(damage)
  with iter(build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0)) as it:
    with pytest.raises(StateMismatchError, match=f"cannot restore the data iterator from {data}"):
      restore(manager, None, {"w": jnp.zeros(3)}, it)
