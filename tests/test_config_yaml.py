"""The config's YAML reader: duplicated keys, alias bombs and special files are refused."""

import re

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from bagel_grain.config import config_from_dict, load_config
from bagel_grain.config_yaml import MAX_ALIAS_NODES, load_yaml_file, load_yaml_text, shown
from bagel_grain.errors import ConfigError
from fifos import fifo
from test_config import minimal


def alias_bomb(levels=9, width=10):
  """YAML whose last anchor expands to width**levels leaves (1e9 by default) in ~1 KB."""
  lines = [f"l0: &l0 [{', '.join(['1'] * width)}]"]
  for i in range(1, levels + 1):
    lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
  return "\n".join(lines) + "\n", f"*l{levels}"


def test_anchors_that_add_a_few_values_load_as_plain_yaml():
  text = ("base: &t {image_stride: 16, max_image_size: 512}\n"
          "a: *t\n"
          "b: {<<: *t, max_image_size: 256}\n")
  assert load_yaml_text(text) == yaml.safe_load(text)
  assert load_yaml_text(text)["b"] == {"image_stride": 16, "max_image_size": 256}


def test_an_alias_bomb_is_refused_while_loading():
  text, top = alias_bomb()
  with pytest.raises(yaml.YAMLError, match=f"more than {MAX_ALIAS_NODES} values"):
    load_yaml_text(text + f"max_num_tokens: {top}\n")


def test_expansion_just_under_the_bound_loads():
  # 10 aliases of a 9,000-value list add 90,000 values (plus the 10 alias nodes).
  items = ", ".join(["1"] * 8999)
  text = f"a: &a [{items}]\nb: [{', '.join(['*a'] * 10)}]\n"
  assert len(load_yaml_text(text)["b"]) == 10


def test_a_recursive_anchor_is_refused():
  with pytest.raises(yaml.YAMLError, match="alias bomb"):
    load_yaml_text("a: &a [1, *a]\n")


def test_a_duplicated_key_is_refused_naming_it_and_its_lines():
  text = "grouped_datasets:\n  vlm_sft: {weight: 1}\n  t2i_pretrain: {}\n  vlm_sft: {weight: 2}\n"
  with pytest.raises(yaml.YAMLError, match=r"duplicate key 'vlm_sft' \(first given at line 2\)"):
    load_yaml_text(text)


def test_a_merge_key_may_be_overridden():
  assert load_yaml_text("a: &a {x: 1}\nb: {<<: *a, x: 2}\n")["b"] == {"x": 2}


@given(st.recursive(st.integers() | st.text(max_size=200),
                    lambda inner: st.lists(inner, max_size=50)
                    | st.dictionaries(st.text(max_size=20), inner, max_size=50), max_leaves=200))
@settings(max_examples=40, deadline=None)
def test_shown_is_one_short_line(value):
  text = shown(value)
  assert len(text) <= 80 and "\n" not in text


def test_shown_of_a_shared_huge_value_is_immediate():
  value = [1] * 10
  for _ in range(9):
    value = [value] * 10  # 1e9 leaves, 100 list objects
  assert len(shown(value)) <= 80


@pytest.mark.parametrize("dotted", ["max_num_tokens", "grouped_datasets.t2i_pretrain.weight",
                                    "grouped_datasets.t2i_pretrain.image_transform_args."
                                    "image_stride"])
def test_an_alias_bomb_as_a_value_is_a_config_error(tmp_path, dotted):
  for folder in ("t2i", "edit", "vlm"):
    (tmp_path / folder).mkdir()
  (tmp_path / "vlm" / "sft.jsonl").write_text("")
  raw = minimal()
  marker = "BOMB_GOES_HERE"
  *parents, last = dotted.split(".")
  node = raw
  for key in parents:
    node = node[key]
  node[last] = marker
  bomb, top = alias_bomb()
  body = yaml.safe_dump(raw).replace(marker, top)
  (tmp_path / "main.yaml").write_text("anchors:\n" + "".join(f"  {line}\n" for line in
                                                            bomb.splitlines()) + body)
  with pytest.raises(ConfigError, match="alias bomb") as e:
    load_config(tmp_path / "main.yaml")
  assert e.value.file == str(tmp_path / "main.yaml")


def test_a_duplicated_group_is_a_config_error_naming_the_file(tmp_path):
  for folder in ("t2i", "edit", "vlm"):
    (tmp_path / folder).mkdir()
  (tmp_path / "vlm" / "sft.jsonl").write_text("")
  raw = minimal()
  text = yaml.safe_dump(raw["grouped_datasets"])
  vlm = text[text.index("vlm_sft:"):]
  (tmp_path / "groups.yaml").write_text(text + vlm.replace("vlm_sft:", "vlm_sft:", 1))
  raw["grouped_datasets"] = "groups.yaml"
  with pytest.raises(ConfigError, match="duplicate key 'vlm_sft'") as e:
    config_from_dict(raw, file="main.yaml", base_dir=str(tmp_path))
  assert e.value.file == str(tmp_path / "groups.yaml")


@pytest.mark.parametrize("which", ["config", "dataset_info", "grouped_datasets"])
def test_a_fifo_config_file_is_refused_unopened(tmp_path, which):
  for folder in ("t2i", "edit", "vlm"):
    (tmp_path / folder).mkdir()
  (tmp_path / "vlm" / "sft.jsonl").write_text("")
  raw = minimal()
  if which != "config":
    raw[which] = f"{which}.yaml"
    (tmp_path / "main.yaml").write_text(yaml.safe_dump(raw))
  target = tmp_path / ("main.yaml" if which == "config" else f"{which}.yaml")
  with fifo(target) as rescued:
    with pytest.raises(ConfigError, match=re.escape(f"{target} is a special file")) as e:
      load_config(tmp_path / "main.yaml")
  assert not rescued, "the FIFO was opened"
  assert e.value.file == str(target)


def test_a_missing_config_file_is_named(tmp_path):
  with pytest.raises(ConfigError, match="config file not found") as e:
    load_yaml_file(str(tmp_path / "nope.yaml"))
  assert e.value.file == str(tmp_path / "nope.yaml")
