"""Every study's README shows exactly what its committed results JSON renders to."""

import importlib.util
import json
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDIES = ["exact_decomposition", "advantage_staleness", "presets_across_staleness"]


def load(study):
  path = os.path.join(ROOT, "experiments", study, "run.py")
  spec = importlib.util.spec_from_file_location(f"{study}_run", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("study", STUDIES)
def test_the_readme_tables_are_rendered_from_the_json(study, tmp_path):
  directory = os.path.join(ROOT, "experiments", study)
  if not os.path.exists(os.path.join(directory, "results.json")):
    pytest.skip(f"{study} has no committed results yet")
  shutil.copy(os.path.join(directory, "README.md"), tmp_path / "README.md")
  with open(os.path.join(directory, "results.json")) as f:
    results = json.load(f)
  module = load(study)
  if study == "presets_across_staleness":
    module.render(results, module.DEFAULT, here=str(tmp_path))
  else:
    module.render(results, here=str(tmp_path))
  with open(os.path.join(directory, "README.md")) as f:
    assert (tmp_path / "README.md").read_text() == f.read()
  assert list(tmp_path.glob("*.png"))
