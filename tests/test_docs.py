"""Every docs/ file the code, tests or README point to exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where references to docs/ live (this file's own examples excluded).
SOURCES = [ROOT / "README.md", *ROOT.glob("bagel_grain/**/*.py"),
           *(p for p in ROOT.glob("tests/*.py") if p.name != "test_docs.py")]


def test_every_docs_path_named_in_code_or_readme_exists():
  named = set()
  for path in SOURCES + list(ROOT.glob("docs/*.md")):
    named |= set(re.findall(r"docs/[\w/]+\.md", path.read_text()))
  assert {"docs/design.md", "docs/packed_row.md"} <= named
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
