"""What the docs name exists: docs/ pages, their sections, repository paths, the code
objects docs/architecture.md points to, and every config key."""

import ast
import dataclasses
import re
from pathlib import Path

from bagel_grain.config import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where references to docs/ live (this file's own examples excluded).
SOURCES = [*PAGES, *ROOT.glob("bagel_grain/**/*.py"),
           *(p for p in ROOT.glob("tests/*.py") if p.name != "test_docs.py")]


def test_every_docs_path_named_in_code_or_readme_exists():
  named = set()
  for path in SOURCES:
    named |= set(re.findall(r"docs/[\w/]+\.md", path.read_text()))
  assert {"docs/design.md", "docs/packed_row.md", "docs/configuration.md"} <= named
  assert not [n for n in named if not (ROOT / n).is_file()]


def test_every_section_a_reference_names_exists():
  # `docs/x.md, "Heading"` and `docs/x.md, section N` (or `sections N and M`).
  refs = []
  for path in SOURCES:
    refs += re.findall(r"(docs/[\w/]+\.md), (\"[^\"]+\"|sections? \d+(?: and \d+)*)", path.read_text())
  assert len(refs) >= 10
  for doc, section in refs:
    headings = re.findall(r"^## (.+)$", (ROOT / doc).read_text(), re.M)
    if section.startswith('"'):
      assert section.strip('"') in headings, (doc, section)
    else:
      for number in re.findall(r"\d+", section):
        assert any(h.startswith(f"{number}. ") for h in headings), (doc, section)


def test_the_readme_links_every_docs_page():
  readme = (ROOT / "README.md").read_text()
  unlinked = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
  assert not unlinked, f"docs pages the README does not link: {unlinked}"


# A path whose first folder exists in the repository (or in the package), so that
# placeholders such as `DIR/config.yaml` or `.demo_data/...` are not taken for ours.
_PATH = re.compile(r"(?<![\w/.<>-])((?:\.\./)?(?:[\w.-]+/)+[\w.-]*\w\.(?:py|md|yaml|json|npy|toml|txt))\b")
_MODULE = re.compile(r"`(\w+\.py)`")


def _existing_path(page: Path, name: str) -> bool | None:
  """True/False whether `name` exists; None when it is not a path into the repository."""
  bases = [ROOT, ROOT / "bagel_grain", page.parent]
  first = Path(name.removeprefix("../")).parts[0]
  if not any((b / first).is_dir() or (b / name).parent.is_dir() for b in bases):
    return None
  return any((b / name).exists() for b in bases)


def test_every_repository_path_the_docs_name_exists():
  code_files = {p.name for d in ("bagel_grain", "tools", "tests") for p in (ROOT / d).rglob("*.py")}
  missing, checked = [], 0
  for page in PAGES:
    # Python blocks run as tests (test_readme.py): their paths are the test's to check.
    text = re.sub(r"^```python\n.*?^```$", "", page.read_text(), flags=re.M | re.S)
    # "a new `families/audio.py`": a file a recipe asks you to write.
    named = {m.group(1) for m in _PATH.finditer(text) if "new " not in text[m.start() - 6:m.start()]}
    for name in named:
      found = _existing_path(page, name)
      checked += found is not None
      if found is False:
        missing.append(f"{page.name}: {name}")
    for name in set(_MODULE.findall(text)):
      checked += 1
      if name not in code_files:
        missing.append(f"{page.name}: {name}")
  assert checked >= 40
  assert not missing, missing


def _package_index() -> tuple[dict[str, dict[str, set[str]]], dict[str, set[str]]]:
  """Module (dotted, and every dotted suffix of it) -> {top-level name: members (of a
  class; empty otherwise)}; class name -> its members (of every class of that name)."""
  modules: dict[str, dict[str, set[str]]] = {}
  classes: dict[str, set[str]] = {}
  for path in (ROOT / "bagel_grain").rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    names: dict[str, set[str]] = {}
    tree = ast.parse(path.read_text())
    for node in tree.body:
      for name in _defined(node):
        names[name] = set()
      if isinstance(node, ast.ClassDef):
        members = {n for item in node.body for n in _defined(item)}
        names[node.name] = members
        classes.setdefault(node.name, set()).update(members)
    for i in range(len(parts)):
      modules.setdefault(".".join(parts[i:]), {}).update(names)
  return modules, classes


def _defined(node: ast.stmt) -> list[str]:
  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
    return [node.name]
  if isinstance(node, ast.Assign):
    return [t.id for t in node.targets if isinstance(t, ast.Name)]
  if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
    return [node.target.id]
  if isinstance(node, (ast.Import, ast.ImportFrom)):
    return [(a.asname or a.name).split(".")[0] for a in node.names]
  return []


def _resolves(dotted: str, modules, classes) -> bool | None:
  """Whether `module.name[.member]` or `Class.member` exists; None when the first part
  is neither a package module nor a package class (`cfg.use_flex`, `jax.Array`)."""
  if dotted in modules:
    return True
  parts = dotted.split(".")
  for cut in range(len(parts) - 1, 0, -1):
    module = ".".join(parts[:cut])
    if module in modules:
      rest = parts[cut:]
      if rest[0] not in modules[module]:
        return False
      return len(rest) == 1 or (len(rest) == 2 and rest[1] in modules[module][rest[0]])
  if parts[0] in classes:
    return len(parts) == 2 and parts[1] in classes[parts[0]]
  return None


def test_every_code_object_architecture_names_exists():
  modules, classes = _package_index()
  text = (ROOT / "docs" / "architecture.md").read_text()
  named = {n for n in re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`", text)
           if not re.search(r"\.(py|md|yaml|json)$", n)}  # file names: the path test's
  results = {name: _resolves(name, modules, classes) for name in named}
  assert sum(r is True for r in results.values()) >= 40
  assert not [n for n, r in results.items() if r is False]
  # A bare CamelCase name is a class or alias of ours (or one the package imports by
  # that name), or one of Grain's or Python's that it subclasses.
  known = {name for names in modules.values() for name in names} | {"IterDataset", "DatasetIterator", "StrEnum"}
  bare = set(re.findall(r"`([A-Z][a-z]\w*)(?:\([^`]*\))?`", text))
  assert len(bare) >= 20
  assert not sorted(bare - known)


def test_every_config_key_is_documented():
  page = (ROOT / "docs" / "configuration.md").read_text()
  documented = set(re.findall(r"`([\w*]+)`", page))
  patterns = [re.compile(d.replace("*", r"\w+") + "$") for d in documented if "*" in d]
  keys = [f.name for f in dataclasses.fields(PipelineConfig) if f.name != "groups"]
  undocumented = [k for k in keys if k not in documented and not any(p.match(k) for p in patterns)]
  assert not undocumented, f"config keys docs/configuration.md does not name: {undocumented}"
