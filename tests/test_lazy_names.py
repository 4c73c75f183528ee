"""The packages' names load their modules on first use, and only then."""

import subprocess
import sys

import pytest


def _run(code: str) -> str:
  return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                        text=True).stdout.strip()


def test_importing_the_package_loads_neither_grain_nor_the_pipeline():
  out = _run("import sys, bagel_grain, bagel_grain.workers; "
             "print(sorted(m for m in ('grain', 'bagel_grain.pipeline', "
             "'bagel_grain.workers.fetcher') if m in sys.modules))")
  assert out == "[]"


def test_a_name_loads_its_module_once_and_is_kept():
  out = _run("import sys, bagel_grain; f = bagel_grain.build_pipeline; "
             "print('bagel_grain.pipeline' in sys.modules, "
             "'build_pipeline' in vars(bagel_grain), f is bagel_grain.build_pipeline)")
  assert out == "True True True"


@pytest.mark.parametrize("package", ["bagel_grain", "bagel_grain.workers"])
def test_an_unknown_name_is_an_attribute_error_naming_the_package(package):
  module = __import__(package, fromlist=["_"])
  with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'nope'"):
    module.nope  # noqa: B018
