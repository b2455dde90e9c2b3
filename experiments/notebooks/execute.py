"""Execute the notebooks top to bottom with nbclient and keep their outputs.

  python experiments/notebooks/execute.py                  # every notebook, full setting, saved in place
  python experiments/notebooks/execute.py quickstart       # one of them
  COPC_NOTEBOOK_SMOKE=1 python experiments/notebooks/execute.py --no-save  # as the tests do
  python experiments/notebooks/execute.py --sync-first-cell   # first_cell.py into every notebook, no run

A notebook that raises stops with the failing cell's error. A notebook whose outputs would show
this checkout's absolute path is not saved (the committed notebooks name no machine's paths).

A saved full-setting run records its wall time for the runtime it ran on (the JAX backend its first
cell printed) in the notebook's metadata, and the title cell states the time per runtime
(`run_time_line`); runtimes no one has measured say so.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NOTEBOOKS = sorted(os.path.basename(p).removesuffix(".ipynb") for p in glob.glob(os.path.join(HERE, "*.ipynb")))


def execute(name: str, timeout_s: int = 3600):
  """Run `name`.ipynb in a fresh kernel of this Python, in the notebooks' folder; the executed notebook."""
  import nbformat
  from nbclient import NotebookClient
  notebook = nbformat.read(os.path.join(HERE, f"{name}.ipynb"), as_version=4)
  NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                 resources={"metadata": {"path": HERE}}).execute()
  return notebook


def machine_paths(notebook) -> list[str]:
  """Outputs that show this checkout's absolute path."""
  import nbformat
  text = nbformat.writes(notebook)
  return [line.strip()[:200] for line in text.splitlines() if ROOT in line]


RUNTIMES = {"cpu": "CPU", "gpu": "GPU", "tpu": "TPU"}
RUN_TIME_PREFIX = "**Run time**"


def backend_of(notebook) -> str | None:
  """The JAX backend a full-setting run used, as its first code cell printed it; None otherwise."""
  cell = next(c for c in notebook.cells if c.cell_type == "code")
  text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
  found = re.search(r"full setting \| JAX backend: (\w+)", text)
  return found.group(1) if found else None


def machine_description(backend: str) -> str:
  """What ran the kernel: the core count on a CPU, the device kind and count on an accelerator."""
  if backend == "cpu":
    return f"{os.cpu_count()} cores"
  import jax
  return f"{len(jax.devices())}× {jax.devices()[0].device_kind}"


def run_time_line(times: dict) -> str:
  """The title cell's sentence: minutes per runtime from the recorded `times` ({backend: record})."""
  def measured(t):
    shared = f", shared with other work: load {t['load_average_at_start']}" if t.get("busy") else ""
    return f"({t['machine']}{shared}) {t['seconds'] / 60:.1f} min"
  parts = [f"{label} {measured(times[key])}" if key in times else f"{label} not measured yet"
           for key, label in RUNTIMES.items()]
  return f"{RUN_TIME_PREFIX} top to bottom, full setting (`execute.py`): " + " · ".join(parts) + "."


def record_run_time(notebook, backend: str, seconds: float, machine: str, load: float) -> None:
  """Keep `seconds` as this runtime's time in the metadata (with the machine's load average when the
  run started: other work on the machine lengthens it) and restate the title cell's run-time line."""
  times = notebook.metadata.setdefault("copc_jax", {}).setdefault("run_time", {})
  times[backend] = {"seconds": round(seconds), "machine": machine, "date": datetime.date.today().isoformat(),
                    "load_average_at_start": round(load, 1), "busy": load > (os.cpu_count() or 1)}
  restate_run_time(notebook)


def restate_run_time(notebook) -> None:
  """The title cell's run-time line, from the times in the notebook's metadata."""
  times = notebook.metadata["copc_jax"]["run_time"]
  title = notebook.cells[0]
  lines = [line for line in title.source.split("\n") if not line.startswith(RUN_TIME_PREFIX)]
  while lines and not lines[-1].strip():
    lines.pop()
  title.source = "\n".join(lines + ["", run_time_line(times)])


FIRST_CELL = os.path.join(HERE, "first_cell.py")


def sync_first_cell(name: str) -> bool:
  """Write `first_cell.py` (the one setup cell every notebook opens with) into `name`.ipynb's first
  code cell, keeping its outputs; True if it changed."""
  import nbformat
  path = os.path.join(HERE, f"{name}.ipynb")
  notebook = nbformat.read(path, as_version=4)
  cell = next(c for c in notebook.cells if c.cell_type == "code")
  with open(FIRST_CELL) as f:
    source = f.read().rstrip("\n")
  if cell.source == source:
    return False
  cell.source = source
  nbformat.write(notebook, path)
  return True


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*", help=f"default: all of {NOTEBOOKS}")
  parser.add_argument("--no-save", action="store_true", help="execute only")
  parser.add_argument("--sync-first-cell", action="store_true",
                      help="write first_cell.py into each, run nothing")
  args = parser.parse_args()
  unknown = set(args.names) - set(NOTEBOOKS)
  if unknown:
    parser.error(f"unknown notebooks {sorted(unknown)}; allowed: {NOTEBOOKS}")
  import nbformat
  if args.sync_first_cell:
    for name in args.names or NOTEBOOKS:
      print(f"{name}: {'updated' if sync_first_cell(name) else 'unchanged'}")
    return
  for name in args.names or NOTEBOOKS:
    start, load = time.time(), os.getloadavg()[0]
    notebook = execute(name)
    seconds = time.time() - start
    print(f"{name}: executed in {seconds:.0f} s", flush=True)
    if args.no_save:
      continue
    backend = backend_of(notebook)
    if backend in RUNTIMES:
      record_run_time(notebook, backend, seconds, machine_description(backend), load)
    leaks = machine_paths(notebook)
    if leaks:
      sys.exit(f"{name}: not saved, its outputs show this checkout's path: {leaks[:3]}")
    nbformat.write(notebook, os.path.join(HERE, f"{name}.ipynb"))


if __name__ == "__main__":
  main()
