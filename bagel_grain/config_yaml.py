"""Reading a config's YAML files as a hostile user may write them.

Three things PyYAML's `safe_load` accepts are refused here, each naming the file:
a path that is not a regular file (opening a FIFO waits forever for a writer), a
mapping key given twice (the last would win silently: a duplicated group would
drop the first), and aliases that expand to a huge value (a "billion laughs":
loading is cheap because aliases share objects, but anything that walks the
value, an error message's `repr` first, would take minutes and gigabytes).
`shown(value)` (`config_values`) is the bounded repr error messages use for any value read.
"""

from __future__ import annotations

from typing import Any

import yaml

from bagel_grain import fs
from bagel_grain.config_values import shown  # (here too: its old home)
from bagel_grain.errors import ConfigError

MAX_CONFIG_BYTES = 64 << 20  # a config, dataset_info or grouped_datasets file
# Nodes that aliases may add to a file beyond those it spells out. Anchors shared by a
# few groups add tens; 1e9 leaves from a 1 KB file is a bomb.
MAX_ALIAS_NODES = 100_000


class _StrictLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
  """SafeLoader that refuses duplicated keys and alias bombs (see the module docstring)."""

  def compose_document(self):
    node = super().compose_document()
    added = _expanded_nodes(node, limit=MAX_ALIAS_NODES) - _distinct_nodes(node)
    if added > MAX_ALIAS_NODES:
      raise yaml.composer.ComposerError(
          None, None, f"aliases expand this document by more than {MAX_ALIAS_NODES} values "
          "(an alias bomb?); write the values out", node.start_mark)
    return node

  def construct_mapping(self, node, deep=False):
    if isinstance(node, yaml.MappingNode):
      seen: dict[Any, Any] = {}
      for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges may be overridden
          continue
        key = self.construct_object(key_node, deep=True)
        try:
          first = seen.setdefault(key, key_node.start_mark)
        except TypeError:
          continue  # an unhashable key: SafeConstructor's own error follows
        if first is not key_node.start_mark:
          raise yaml.constructor.ConstructorError(
              "while constructing a mapping", node.start_mark,
              f"found duplicate key {shown(key)} (first given at line {first.line + 1}); "
              "a key may appear once", key_node.start_mark)
    return super().construct_mapping(node, deep=deep)


def _children(node: yaml.Node) -> list[yaml.Node]:
  if isinstance(node, yaml.SequenceNode):
    return list(node.value)
  if isinstance(node, yaml.MappingNode):
    return [n for pair in node.value for n in pair]
  return []


def _distinct_nodes(root: yaml.Node) -> int:
  seen, todo = {id(root)}, [root]
  while todo:
    for child in _children(todo.pop()):
      if id(child) not in seen:
        seen.add(id(child))
        todo.append(child)
  return len(seen)


def _expanded_nodes(root: yaml.Node, limit: int) -> int:
  """How many nodes the document has once every alias is replaced by a copy of its value.

  Each distinct node's count is computed once (post-order, no recursion); a cycle (an
  anchor used inside itself) expands without end and counts as over any limit.
  """
  counts: dict[int, int] = {}
  on_path: set[int] = set()
  todo: list[tuple[yaml.Node, bool]] = [(root, False)]
  over = limit + _distinct_nodes(root) + 1
  while todo:
    node, children_done = todo.pop()
    key = id(node)
    if children_done:
      on_path.discard(key)
      counts[key] = min(over, 1 + sum(counts[id(c)] for c in _children(node)))
      continue
    if key in counts:
      continue
    if key in on_path:
      return over
    on_path.add(key)
    todo.append((node, True))
    for child in _children(node):
      if id(child) in on_path:
        return over
      if id(child) not in counts:
        todo.append((child, False))
  return counts[id(root)]


def load_yaml_file(path: str, *, what: str = "config file") -> Any:
  """The parsed YAML of `path`, a regular file; ConfigError naming it otherwise."""
  kind = fs.kind(path)
  if kind == "missing":
    raise ConfigError(f"{what} not found", file=path)
  if kind != "file":
    raise ConfigError(f"{path} is a {kind}; a {what} must be a regular file", file=path)
  try:  # refuses a FIFO swapped in after the check too, without waiting for a writer
    data = fs.read_file(path, MAX_CONFIG_BYTES)
  except fs.FileRefused as e:
    raise ConfigError(f"cannot read {what}: {e} (at most {MAX_CONFIG_BYTES} bytes, regular "
                      "files only)", file=path) from None
  except OSError as e:
    raise ConfigError(f"cannot read {what}: {e}", file=path) from None
  try:
    return load_yaml_text(data.decode("utf-8"))
  except UnicodeDecodeError as e:
    raise ConfigError(f"{what} is not UTF-8 text: {e}", file=path) from None
  except yaml.YAMLError as e:
    raise ConfigError(f"invalid YAML: {e}", file=path) from None


def load_yaml_text(text: str) -> Any:
  """Parses one YAML document with the checks above (yaml.YAMLError when refused)."""
  loader = _StrictLoader(text)
  try:
    return loader.get_single_data()
  finally:
    loader.dispose()
