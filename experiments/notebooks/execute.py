"""Execute the notebooks top to bottom with nbclient and keep their outputs.

  python experiments/notebooks/execute.py                  # every notebook, full setting, saved in place
  python experiments/notebooks/execute.py quickstart       # one of them
  COPC_NOTEBOOK_SMOKE=1 python experiments/notebooks/execute.py --no-save  # as the tests do

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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*", help=f"default: all of {NOTEBOOKS}")
  parser.add_argument("--no-save", action="store_true", help="execute only")
  args = parser.parse_args()
  unknown = set(args.names) - set(NOTEBOOKS)
  if unknown:
    parser.error(f"unknown notebooks {sorted(unknown)}; allowed: {NOTEBOOKS}")
  import nbformat
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
