"""The tokenizer wrapper: BAGEL's special tokens, upstream's encode, pickling, fingerprint."""

import importlib.util
import pickle
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from bagel_grain.tooling import demo_data
from bagel_grain.configs import shipped_path
from bagel_grain.errors import ConfigError
from bagel_grain.sample import SpecialTokens
from bagel_grain.tokenizer import BAGEL_TOKENS, Tokenizer, load_tokenizer

SENTENCES = [
  "A small red circle in the top left on a blue to green gradient.",
  "Add a large yellow square in the center.",
  "The quiet river carries the wooden lantern across the meadow.",
  "  two  spaces, tabs\tand a newline\nhere: 123 + 45 = 168!",
  "",
  "x",
]


@pytest.fixture(scope="module")
def demo_tokenizer_dir(tmp_path_factory):
  root = demo_data.make_sample_data(tmp_path_factory.mktemp("demo"))
  return root / "tokenizer"


def _bpe_json(tmp_path, special=()):
  """A tiny byte-level BPE saved as tokenizer.json, with the given special tokens."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(SENTENCES * 5, trainer)
  if special:
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in special])
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  return path


def test_special_tokens_are_four_distinct_ids(demo_tokenizer_dir):
  tok = load_tokenizer(demo_tokenizer_dir)
  assert isinstance(tok.special, SpecialTokens)
  ids = [tok.special.bos, tok.special.eos, tok.special.start_of_image, tok.special.end_of_image]
  assert len(set(ids)) == 4
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode([tok.special.bos]) == "<|im_start|>"
  assert tok.decode([tok.special.end_of_image]) == "<|vision_end|>"


def test_encode_adds_no_special_tokens_and_round_trips(demo_tokenizer_dir):
  tok = load_tokenizer(demo_tokenizer_dir)
  specials = set(tok.special.__dict__.values())
  for text in SENTENCES:
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert not specials & set(ids.tolist())
    assert tok.decode(ids) == text
  assert tok.encode("").shape == (0,)


def test_special_token_text_maps_to_its_id(demo_tokenizer_dir):
  tok = load_tokenizer(demo_tokenizer_dir)
  ids = tok.encode("<|im_start|>hi<|im_end|>").tolist()
  assert ids[0] == tok.special.bos and ids[-1] == tok.special.eos


def test_encode_batch_equals_encode(demo_tokenizer_dir):
  tok = load_tokenizer(demo_tokenizer_dir)
  batch = tok.encode_batch(SENTENCES)
  assert len(batch) == len(SENTENCES)
  for text, ids in zip(SENTENCES, batch):
    np.testing.assert_array_equal(ids, tok.encode(text))
    assert ids.dtype == np.int32
  assert tok.encode_batch([]) == []


def test_pickle_round_trip_keeps_ids_and_fingerprint(demo_tokenizer_dir):
  tok = load_tokenizer(demo_tokenizer_dir)
  clone = pickle.loads(pickle.dumps(tok))
  assert clone.special == tok.special
  assert clone.vocab_size == tok.vocab_size
  assert clone.fingerprint() == tok.fingerprint()
  for text in SENTENCES:
    np.testing.assert_array_equal(clone.encode(text), tok.encode(text))


def test_directory_and_json_file_give_identical_ids(demo_tokenizer_dir):
  from_dir = load_tokenizer(demo_tokenizer_dir)
  from_file = load_tokenizer(demo_tokenizer_dir / "tokenizer.json")
  assert from_dir.special == from_file.special
  assert from_dir.vocab_size == from_file.vocab_size
  assert from_dir.fingerprint() == from_file.fingerprint()
  for a, b in zip(from_dir.encode_batch(SENTENCES), from_file.encode_batch(SENTENCES)):
    np.testing.assert_array_equal(a, b)


def test_ids_equal_transformers_encode(demo_tokenizer_dir):
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoTokenizer.from_pretrained(str(demo_tokenizer_dir), local_files_only=True)
  tok = load_tokenizer(demo_tokenizer_dir)
  for text in SENTENCES + ["<|vision_start|> and <|im_end|>"]:
    assert tok.encode(text).tolist() == hf.encode(text, add_special_tokens=False)


def test_existing_special_token_keeps_its_id_and_missing_ones_are_added(tmp_path):
  path = _bpe_json(tmp_path, special=("<|endoftext|>", "<|im_start|>"))
  raw = tokenizers.Tokenizer.from_file(str(path))
  tok = Tokenizer(path)
  assert tok.special.bos == raw.token_to_id("<|im_start|>")
  assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) + 3
  assert {tok.special.eos, tok.special.start_of_image, tok.special.end_of_image} == set(
    range(raw.get_vocab_size(with_added_tokens=True), tok.vocab_size))
  # Added as special tokens: matched whole, never split into bytes.
  assert tok.encode("<|vision_start|>").tolist() == [tok.special.start_of_image]


def test_tokenizer_with_all_bagel_tokens_is_unchanged(demo_tokenizer_dir):
  raw = tokenizers.Tokenizer.from_file(str(demo_tokenizer_dir / "tokenizer.json"))
  tok = load_tokenizer(demo_tokenizer_dir / "tokenizer.json")
  assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
  assert list(tok.special.__dict__.values()) == [raw.token_to_id(t) for t in BAGEL_TOKENS]


def test_fingerprint_changes_when_a_token_is_added(tmp_path):
  path = _bpe_json(tmp_path)
  before = Tokenizer(path).fingerprint()
  assert Tokenizer(path).fingerprint() == before  # stable across loads
  raw = tokenizers.Tokenizer.from_file(str(path))
  raw.add_tokens(["<|new_token|>"])
  raw.save(str(path))
  assert Tokenizer(path).fingerprint() != before


def test_missing_path_is_a_clear_error(tmp_path):
  with pytest.raises(ConfigError, match="does not exist.*tokenizer_path"):
    load_tokenizer(tmp_path / "nope")


def test_tokenizer_without_rust_backend_falls_back_to_transformers(tmp_path):
  """ByT5 is a pure-Python tokenizer: no files needed, no Rust backend."""
  transformers = pytest.importorskip("transformers")
  (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "ByT5Tokenizer"}')
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
  if getattr(hf, "backend_tokenizer", None) is not None:
    pytest.skip("this transformers version gives ByT5 a Rust backend")
  tok = load_tokenizer(tmp_path)
  assert tok.vocab_size == len(hf) + 4
  assert len(set(tok.special.__dict__.values())) == 4
  ids = tok.encode("hi <|im_start|>")
  assert ids.dtype == np.int32 and ids[-1] == tok.special.bos
  assert [x.tolist() for x in tok.encode_batch(SENTENCES)] == [
    tok.encode(t).tolist() for t in SENTENCES]
  clone = pickle.loads(pickle.dumps(tok))
  assert clone.fingerprint() == tok.fingerprint() and clone.special == tok.special


QUIET_CHILD = textwrap.dedent("""
    import logging, os, sys
    import yaml
    from bagel_grain.config import config_from_dict
    from bagel_grain.pipeline import build_pipeline
    from bagel_grain.tokenizer import load_tokenizer

    demo_dir, config = sys.argv[1:]
    raw = yaml.safe_load(open(config))
    raw["dataset_info"] = os.path.join(demo_dir, "dataset_info.yaml")
    raw["tokenizer_path"] = os.path.join(demo_dir, "tokenizer")
    cfg = config_from_dict(raw, file=config, base_dir=os.path.dirname(config))
    tokenizer = load_tokenizer(cfg.tokenizer_path)  # the folder: goes through transformers
    assert "transformers" in sys.modules
    it = iter(build_pipeline(cfg, tokenizer, batch_size=1, workers=2))
    try:
      for _ in range(3):
        next(it)
    finally:
      it.close()
    print("filters left on the transformers logger:", len(logging.getLogger("transformers").filters))
""")
TORCH_ADVICE = "PyTorch was not found"


def test_loading_a_tokenizer_folder_prints_no_torch_advice_in_any_process(demo_dir):
  config = str(shipped_path("demo"))
  child = subprocess.run([sys.executable, "-c", QUIET_CHILD, str(demo_dir), config],
                         capture_output=True, text=True, timeout=300, check=False)
  assert child.returncode == 0, child.stderr[-3000:]
  assert TORCH_ADVICE not in child.stderr + child.stdout
  assert "filters left on the transformers logger: 0" in child.stdout
  # Without torch a bare import prints the advice: the check above is not vacuous.
  if importlib.util.find_spec("torch") is None:
    bare = subprocess.run([sys.executable, "-c", "import transformers"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert TORCH_ADVICE in bare.stderr


# --- hostile paths and files ---------------------------------------------------------


def test_a_malformed_tokenizer_json_in_a_folder_names_the_file(tmp_path):
  (tmp_path / "tokenizer.json").write_text('{"model": 1}')
  (tmp_path / "tokenizer_config.json").write_text("{}")
  with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'tokenizer.json'} is not a "
                                                  "tokenizers JSON file")):
    load_tokenizer(tmp_path)
