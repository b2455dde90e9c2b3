"""The Colab notebooks (experiments/notebooks/): executed top to bottom in the smoke setting, and the
committed ones carry the outputs of a real run, show the studies' committed figures, and are linked."""

import base64
import glob
import importlib.util
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, "experiments", "notebooks")
STUDIES = sorted(d for d in os.listdir(os.path.join(ROOT, "experiments"))
                 if os.path.exists(os.path.join(ROOT, "experiments", d, "run.py")))
# Executed by another test, which checks what its live cell wrote (tests/test_study_smoke.py).
EXECUTED_ELSEWHERE = {"advantage_staleness"}


def load_notebook_runner():
  spec = importlib.util.spec_from_file_location("notebooks_execute", os.path.join(NOTEBOOK_DIR, "execute.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


NOTEBOOKS = load_notebook_runner().NOTEBOOKS


def read(name: str) -> dict:
  with open(os.path.join(NOTEBOOK_DIR, f"{name}.ipynb")) as f:
    return json.load(f)


def test_every_study_and_the_quickstart_has_a_notebook():
  assert set(NOTEBOOKS) == set(STUDIES) | {"quickstart"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NOTEBOOKS if n not in EXECUTED_ELSEWHERE])
def test_a_notebook_runs_top_to_bottom_in_the_smoke_setting(name, tmp_path, monkeypatch):
  monkeypatch.setenv("COPC_NOTEBOOK_SMOKE", "1")
  monkeypatch.setenv("COPC_NOTEBOOK_OUT", str(tmp_path))
  monkeypatch.setenv("XLA_FLAGS", "")
  notebook = load_notebook_runner().execute(name, timeout_s=900)      # a cell that raises fails here
  assert all(cell.get("execution_count") for cell in notebook.cells if cell.cell_type == "code")
  if name in ("quickstart", "search_stability"):                       # a live run of the main job
    assert os.path.exists(tmp_path / name / "metrics.jsonl")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebooks_carry_the_outputs_of_a_full_run_and_no_machine_paths(name):
  notebook = read(name)
  code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
  assert code and all(cell["execution_count"] for cell in code), "execute it: experiments/notebooks/execute.py"
  outputs = [output for cell in code for output in cell["outputs"]]
  assert not [o for o in outputs if o["output_type"] == "error"]
  text = json.dumps(outputs)
  assert "smoke setting" not in text and "full setting" in text
  assert not re.search(r"/(home|root|Users|work)/", text), "outputs show a machine's paths"


@pytest.mark.parametrize("name", STUDIES)
def test_the_notebooks_show_the_figures_of_the_committed_json(name):
  """Every figure a study has rendered from its committed JSON, byte for byte (a study re-rendered
  after new results needs its notebook executed again)."""
  code = [cell for cell in read(name)["cells"] if cell["cell_type"] == "code"]
  shown = [base64.b64decode(o["data"]["image/png"]) for cell in code for o in cell["outputs"]
           if "image/png" in o.get("data", {})]
  for figure in glob.glob(os.path.join(ROOT, "experiments", name, "*.png")):
    with open(figure, "rb") as f:
      assert f.read() in shown, f"{name}.ipynb does not show {os.path.basename(figure)}: execute it again"


def test_the_readme_links_every_notebook_in_colab():
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  for name in NOTEBOOKS:
    assert (f"https://colab.research.google.com/github/copc-jax/copc_jax/blob/main/experiments/notebooks/"
            f"{name}.ipynb") in readme


def test_every_notebook_opens_with_the_one_setup_cell():
  with open(os.path.join(NOTEBOOK_DIR, "first_cell.py")) as f:
    source = f.read().rstrip("\n")
  for name in NOTEBOOKS:
    first = next(c for c in read(name)["cells"] if c["cell_type"] == "code")
    assert "".join(first["source"]) == source, f"{name}: run execute.py --sync-first-cell"


@pytest.mark.parametrize("colab", [False, True])
def test_the_setup_cell_runs_twice_in_one_kernel(tmp_path, colab):
  """As after Colab's runtime restart: the second run finds the clone and its install (a marker) and
  chdirs again. In the Colab branch the clone is this checkout's copy and the marker names this
  machine's backend, so nothing is installed; the backend check runs."""
  import nbformat
  from nbclient import NotebookClient

  with open(os.path.join(NOTEBOOK_DIR, "first_cell.py")) as f:
    cell = f.read()
  if colab:
    clone = tmp_path / "clone"
    os.makedirs(clone / "experiments")
    for name in ("pyproject.toml", "README.md"):
      os.symlink(os.path.join(ROOT, name), clone / name)
    for name in ("copc_jax", "configs"):
      os.symlink(os.path.join(ROOT, name), clone / name)
    os.symlink(NOTEBOOK_DIR, clone / "experiments" / "notebooks")
    (clone / ".colab_installed").write_text("cpu")
    # google.colab as far as the cell and jax's debugger (which imports google.colab.output) look
    prelude = (f"import os, sys, types\ncolab = types.ModuleType('google.colab')\n"
               f"colab.output = types.ModuleType('google.colab.output')\n"
               f"sys.modules.update({{'google.colab': colab, 'google.colab.output': colab.output}})\n"
               f"os.environ['COPC_REPO_DIR'] = {str(clone)!r}\n")
  else:
    prelude = f"import os\nos.chdir({ROOT!r})\n"          # a checkout, started from its root
  check = "import os\nprint('cwd', os.path.basename(os.getcwd()), nb.__name__)\n"
  cells = [nbformat.v4.new_code_cell(source) for source in (prelude, cell, cell, check)]
  notebook = nbformat.v4.new_notebook(cells=cells)
  NotebookClient(notebook, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = ["".join(o.get("text", "") for o in c.outputs) for c in notebook.cells]
  assert outputs[1] == outputs[2] and "JAX backend: cpu" in outputs[2]
  assert outputs[3].strip() == "cwd notebooks notebook_lib"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_notebook_states_its_measured_run_time_per_runtime(name):
  """The title cell's run-time line is the one the recorded times give, and the CPU time is measured."""
  notebook = read(name)
  times = notebook["metadata"].get("copc_jax", {}).get("run_time", {})
  assert "cpu" in times, "execute it: experiments/notebooks/execute.py records its run time"
  runner = load_notebook_runner()
  assert runner.run_time_line(times) in "".join(notebook["cells"][0]["source"]).splitlines()


def test_a_recorded_run_time_replaces_the_previous_line_and_keeps_other_runtimes():
  import nbformat
  runner = load_notebook_runner()
  notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Title\n\nText.")])
  runner.record_run_time(notebook, "gpu", 90, "1× H100", 0.5)
  runner.record_run_time(notebook, "cpu", 600, "2 cores", 1.0)
  runner.record_run_time(notebook, "cpu", 300, "2 cores", 0.0)
  assert notebook.cells[0].source == (
      "# Title\n\nText.\n\n**Run time** top to bottom, full setting (`execute.py`): CPU (2 cores) 5.0 min · "
      "GPU (1× H100) 1.5 min · TPU not measured yet.")
  runner.record_run_time(notebook, "cpu", 300, "2 cores", 1000.0)          # measured beside other work
  assert "CPU (2 cores, shared with other work: load 1000.0) 5.0 min" in notebook.cells[0].source
  assert notebook.metadata["copc_jax"]["run_time"]["gpu"]["seconds"] == 90
