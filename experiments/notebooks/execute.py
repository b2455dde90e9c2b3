"""Execute the notebooks top to bottom with nbclient and keep their outputs.

  python experiments/notebooks/execute.py                  # every notebook, full setting, saved in place
  python experiments/notebooks/execute.py quickstart       # one of them
  COPC_NOTEBOOK_SMOKE=1 python experiments/notebooks/execute.py --no-save  # as the tests do
  python experiments/notebooks/execute.py --sync-first-cell   # first_cell.py into every notebook, no run

A notebook that raises stops with the failing cell's error. A notebook whose outputs would show
this checkout's absolute path is not saved (the committed notebooks name no machine's paths).
"""

from __future__ import annotations

import argparse
import glob
import os
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
    start = time.time()
    notebook = execute(name)
    print(f"{name}: executed in {time.time() - start:.0f} s", flush=True)
    if args.no_save:
      continue
    leaks = machine_paths(notebook)
    if leaks:
      sys.exit(f"{name}: not saved, its outputs show this checkout's path: {leaks[:3]}")
    nbformat.write(notebook, os.path.join(HERE, f"{name}.ipynb"))


if __name__ == "__main__":
  main()
