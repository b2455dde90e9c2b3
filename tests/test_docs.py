"""The docs name only what the repository has: every relative link and every repository path in
backticks in the READMEs exists."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "tpu_scripts/README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT)),
        *sorted(glob.glob("experiments/*/README.md", root_dir=ROOT))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)|<img src=\"([^\"]+)\"")
PATH = re.compile(r"`((?:copc_jax|experiments|configs|tests|tpu_scripts)/[A-Za-z0-9_./*-]+)`")


def test_every_relative_link_and_repository_path_in_the_docs_exists():
  missing = []
  for doc in DOCS:
    with open(os.path.join(ROOT, doc)) as f:
      text = f.read()
    base = os.path.dirname(os.path.join(ROOT, doc))
    for link in (markdown or html for markdown, html in LINK.findall(text)):
      external = link.startswith(("http://", "https://", "mailto:"))
      if not external and not os.path.exists(os.path.join(base, link)):
        missing.append(f"{doc}: link {link}")
    for path in PATH.findall(text):
      if not glob.glob(os.path.join(ROOT, path.rstrip("."))):
        missing.append(f"{doc}: path {path}")
  assert not missing, missing
  for doc in DOCS:                    # no file from outside the repository
    with open(os.path.join(ROOT, doc)) as f:
      assert "COPC.md" not in f.read(), doc


def test_the_readme_is_a_front_door():
  """At most 250 lines, the two commands on its first screen, and the figures it embeds exist."""
  with open(os.path.join(ROOT, "README.md")) as f:
    lines = f.read().splitlines()
  assert len(lines) <= 250, len(lines)
  first_screen = "\n".join(lines[:40])
  assert "bash setup.sh && .venv/bin/python -m copc_jax.main --config=configs/default.py" in first_screen
  assert ".venv/bin/python -m pytest -q" in first_screen
  figures = re.findall(r"(?:!\[[^]]*\]\(|<img src=\")([^)\"]+\.png)", "\n".join(lines))
  assert len(figures) >= 3 and all(os.path.exists(os.path.join(ROOT, f)) for f in figures), figures
