"""What the notebooks share: the repository's place, the smoke setting, the accelerator, a study's
figures and table from its committed JSON, and a run of the main job with a live plot.

`COPC_NOTEBOOK_SMOKE=1` shrinks every live run to seconds (CI executes the notebooks that way,
`tests/test_notebooks.py`); unset, a notebook runs its cells at the size its text states.
`COPC_NOTEBOOK_OUT=DIR` puts every live run's files under DIR (the tests check them).
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENTS = os.path.join(ROOT, "experiments")
if ROOT not in sys.path:             # a notebook's kernel starts in experiments/notebooks/ (or in Colab)
  sys.path.insert(0, ROOT)

# On a GPU the notebook's kernel, the learner and the servers are separate processes on one device: each
# takes memory as it needs it instead of XLA's default of 75% at start (set before JAX is imported).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# tqdm's notebook bar needs ipywidgets; without it tqdm warns once, naming its own file.
warnings.filterwarnings("ignore", message="IProgress not found")

SMOKE = os.environ.get("COPC_NOTEBOOK_SMOKE", "") not in ("", "0")


def size(full, smoke):
  """`smoke` under COPC_NOTEBOOK_SMOKE=1, else `full`."""
  return smoke if SMOKE else full


def scratch_dir(name: str) -> str:
  """A fresh folder for a live run: `$COPC_NOTEBOOK_OUT/name` when set (the tests read what the
  notebooks' live cells wrote), else a new temporary folder."""
  parent = os.environ.get("COPC_NOTEBOOK_OUT")
  if not parent:
    return tempfile.mkdtemp(prefix=f"copc_{name}_")
  path = os.path.join(parent, name)
  os.makedirs(path, exist_ok=True)
  return path


def accelerator() -> str:
  """The JAX backend of this runtime: "cpu", "gpu" or "tpu"."""
  import jax
  return jax.default_backend()


def server_platform(backend: str) -> str:
  """`config.rollout.server_platform` for local servers on this runtime.

  cpu: "cpu". gpu: "" (the environment's: the learner and the servers share the GPU; no process
  preallocates its memory, see below). tpu: "cpu", because a TPU chip belongs to one process and the
  learner holds it; on a TPU VM with servers on other hosts, give their addresses in
  `rollout.addresses` instead.
  """
  return "" if backend == "gpu" else "cpu"


def load_study(name: str):
  """`experiments/<name>/run.py` as a module (`experiments.<name>.run`)."""
  return importlib.import_module(f"experiments.{name}.run")


def study_results(name: str, json_name: str = "results") -> dict:
  with open(os.path.join(EXPERIMENTS, name, f"{json_name}.json")) as f:
    return json.load(f)


def show_study(name: str, json_name: str = "results", markers: str | None = None, **render_kwargs) -> str:
  """Render the study's table and figures from its committed JSON (the study's own `render`, into a
  scratch copy of its README) and display them; returns the rendered markdown."""
  import matplotlib
  import matplotlib.pyplot as plt
  from IPython.display import Image, Markdown, display
  backend = matplotlib.get_backend()        # the studies' render switches to Agg; the notebook keeps its own
  scratch = tempfile.mkdtemp(prefix=f"copc_{name}_")
  try:
    shutil.copy(os.path.join(EXPERIMENTS, name, "README.md"), scratch)
    render = load_study(name).render
    if "name" in inspect.signature(render).parameters:       # studies with several JSON files
      render_kwargs.setdefault("name", json_name)
    render(study_results(name, json_name), here=scratch, **render_kwargs)
    with open(os.path.join(scratch, "README.md")) as f:
      readme = f.read()
    marker = markers or json_name
    text = readme.split(f"<!-- {marker}:begin -->", 1)[1].split(f"<!-- {marker}:end -->", 1)[0].strip()
    figures = [line.split("(", 1)[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    display(Markdown("\n".join(line for line in text.splitlines() if not line.startswith("!["))))
    for figure in figures:
      display(Image(filename=os.path.join(scratch, figure)))
    return text
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
    plt.switch_backend(backend)


def _plot(rows: list[dict], keys: list[str], title: str) -> bytes:
  from matplotlib.figure import Figure  # no pyplot: the notebook's backend stays as it is
  fig = Figure(figsize=(4.2 * len(keys), 3.0))
  axes = fig.subplots(1, len(keys), squeeze=False)
  for ax, key in zip(axes[0], keys, strict=True):
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if points:
      ax.plot(*zip(*points), marker=".")
    ax.set_title(key, fontsize=9)
    ax.set_xlabel("update")
    ax.grid(alpha=0.3)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=90)
  return buffer.getvalue()


def run_main(config: str, workdir: str, flags: list[str], *, plot: tuple[str, ...] = (),
             poll_s: float = 3.0) -> list[dict]:
  """`python -m copc_jax.main --config=CONFIG --workdir=WORKDIR FLAGS…` in a subprocess, plotting the
  `plot` metrics of metrics.jsonl live while it runs; returns its metrics rows (raises with the log's
  tail if it fails)."""
  from IPython.display import Image, display

  from copc_jax.train import metrics
  os.makedirs(workdir, exist_ok=True)
  command = [sys.executable, "-m", "copc_jax.main", f"--config={config}", f"--workdir={workdir}",
             "--config.trainer.progress_bar=False", *flags]
  log_path = os.path.join(workdir, "stdout.log")
  handle = display(Image(data=_plot([], list(plot), "starting …")), display_id=True) if plot else None
  with open(log_path, "w") as log:
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    shown = -1
    while True:
      finished = process.poll() is not None
      rows = metrics.read_metrics(workdir)
      if handle is not None and len(rows) != shown:
        handle.update(Image(data=_plot(rows, list(plot), f"{config}: {len(rows)} metrics rows")))
        shown = len(rows)
      if finished:
        break
      time.sleep(poll_s)
  if process.returncode != 0:
    with open(log_path) as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f"the main job exited with {process.returncode}; its log ends:\n{tail}")
  return metrics.read_metrics(workdir)
