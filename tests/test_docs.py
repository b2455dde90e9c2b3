"""The docs name only what the repository has: every relative link and every repository path in
backticks in the READMEs exists."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "tpu_scripts/README.md", *sorted(glob.glob("experiments/*/README.md", root_dir=ROOT))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PATH = re.compile(r"`((?:copc_jax|experiments|configs|tests|tpu_scripts)/[A-Za-z0-9_./*-]+)`")


def test_every_relative_link_and_repository_path_in_the_docs_exists():
  missing = []
  for doc in DOCS:
    with open(os.path.join(ROOT, doc)) as f:
      text = f.read()
    base = os.path.dirname(os.path.join(ROOT, doc))
    for link in LINK.findall(text):
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
