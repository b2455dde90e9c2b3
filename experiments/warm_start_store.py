"""The studies' warm starts, shipped in the repository: one per task config and seed, so that every cell
of a seed begins from the same weights in whichever session, and on whichever CPU, it runs.

Why shipped: XLA compiles for the host's vector instructions, so the same commit builds another warm start
on another CPU (other float32 sums, other weights; held-out accuracy at update 0 for seeds 0-3 of the
tool-arithmetic config moved from 0.320/0.445/0.422/0.563 to 0.328/0.516/0.305/0.414 between two
machines). A study whose cells run in different sessions would otherwise pair runs that began elsewhere.

  python -m experiments.warm_start_store --config configs/default.py --seeds 0 1 2 3   # build, record
  python -m experiments.warm_start_store --config configs/default.py --seeds 0 1 2 3 --from-root R
      # adopt the warm starts a study already built under R (R/_warm_start/seed<S>/model)
  python -m experiments.warm_start_store --check   # every shipped warm start against its digest

`warm_starts/manifest.json` holds, per config file, the settings a warm start depends on (the config's
`model`, `task` and `warm_start` sections) and per seed the digest of its files (`digest`), the
CPU's instruction set it was built on and the commit. `study.shared_warm_start` uses a shipped warm start
whenever the study's settings equal the recorded ones, and refuses a study root that already holds
another one.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile

from copc_jax.train import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
STORE = os.path.join(HERE, "warm_starts")
MANIFEST = os.path.join(STORE, "manifest.json")


def digest(directory: str) -> str:
  """The SHA-256 (first 16 hex digits) of the files under `directory`, by relative path: which warm
  start a run began from (a warm start built again on another CPU differs: XLA sums in another order)."""
  h = hashlib.sha256()
  for base, dirs, files in sorted(os.walk(directory)):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(base, name)
      h.update(os.path.relpath(path, directory).encode())
      with open(path, "rb") as f:
        h.update(f.read())
  return h.hexdigest()[:16]


def settings(typed) -> dict:
  """What a warm start depends on besides the seed: the typed config's model, task and warm-start
  sections, as JSON values."""
  return json.loads(json.dumps({name: dataclasses.asdict(getattr(typed, name))
                                for name in ("model", "task", "warm_start")}, default=str))


def name_of(config: str) -> str:
  """The store's name for a config file: `configs/default.py` → `default`."""
  return os.path.splitext(os.path.basename(config))[0]


def manifest(path: str = MANIFEST) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def lookup(config: str, typed, seed: int, store: str = STORE) -> tuple[str, str] | None:
  """(directory, digest) of the shipped warm start of `config` and `seed` if one was recorded with these
  settings, else None. A shipped directory whose files no longer match its digest is an error."""
  entry = manifest(os.path.join(store, "manifest.json")).get(name_of(config))
  if entry is None or entry["settings"] != settings(typed) or str(seed) not in entry["seeds"]:
    return None
  directory = os.path.join(store, name_of(config), f"seed{seed}")
  expected = entry["seeds"][str(seed)]["digest"]
  found = digest(directory) if os.path.isdir(directory) else "missing"
  if found != expected:
    raise ValueError(f"shipped warm start {os.path.relpath(directory, HERE)}: digest {found}, manifest says "
                     f"{expected}; restore it from git (git checkout -- experiments/warm_starts)")
  return directory, expected


def install(config: str, typed, seed: int, model_dir: str, store: str = STORE) -> str | None:
  """Put the shipped warm start of `config` and `seed` at `model_dir` (a study's `_warm_start/seed<S>/model`)
  and return its digest; None where none is shipped for these settings. A `model_dir` that already holds
  another warm start is refused: its runs would not pair with the shipped one's."""
  shipped = lookup(config, typed, seed, store)
  if shipped is None:
    return None
  directory, expected = shipped
  if os.path.exists(model_dir):
    found = digest(model_dir)
    if found != expected:
      raise ValueError(f"{model_dir}: another warm start (digest {found}) than the shipped one for "
                       f"{name_of(config)} seed {seed} ({expected}); use another --root, or remove it")
    return expected
  os.makedirs(os.path.dirname(model_dir), exist_ok=True)
  checkpoint.write_atomically(model_dir, lambda tmp: shutil.copytree(directory, tmp))
  return expected


def record(config: str, typed, seed: int, model_dir: str, *, git_commit: str, store: str = STORE) -> dict:
  """Copy `model_dir` into the store as `config`'s warm start for `seed` and write it in the manifest."""
  from experiments import numerics_fingerprint
  path = os.path.join(store, "manifest.json")
  table = manifest(path)
  entry = table.setdefault(name_of(config), {"config": config, "settings": settings(typed), "seeds": {}})
  if entry["settings"] != settings(typed):
    raise ValueError(f"{config}: its model/task/warm_start settings changed since its warm starts were "
                     f"recorded; remove {name_of(config)} from {path} to record new ones")
  target = os.path.join(store, name_of(config), f"seed{seed}")
  checkpoint.write_atomically(target, lambda tmp: shutil.copytree(model_dir, tmp))
  entry["seeds"][str(seed)] = {"digest": digest(target), "cpu": numerics_fingerprint.cpu_signature(),
                               "git_commit": git_commit}
  with open(path, "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)
    f.write("\n")
  return entry["seeds"][str(seed)]


def check(store: str = STORE) -> list[str]:
  """The shipped warm starts whose files do not match their digest (empty: all match)."""
  wrong = []
  for name, entry in manifest(os.path.join(store, "manifest.json")).items():
    for seed, row in entry["seeds"].items():
      directory = os.path.join(store, name, f"seed{seed}")
      if not os.path.isdir(directory) or digest(directory) != row["digest"]:
        wrong.append(f"{name} seed {seed}")
  return wrong


def main():
  from experiments import study
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/default.py")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
  parser.add_argument("--from-root", help="adopt the warm starts a study built under this root")
  parser.add_argument("--built-at", help="with --from-root: the commit that built them (default: this one)")
  parser.add_argument("--check", action="store_true", help="only check the shipped ones' digests")
  args = parser.parse_args()
  if args.check:
    wrong = check()
    print("all shipped warm starts match their digests" if not wrong else f"do not match: {wrong}")
    raise SystemExit(1 if wrong else 0)
  build_root = tempfile.mkdtemp(prefix="copc_warm_start_")
  for seed in args.seeds:
    typed = study.load_config(args.config, {}, seed)
    if args.from_root:
      model_dir = os.path.join(args.from_root, "_warm_start", f"seed{seed}", "model")
      if not os.path.isdir(model_dir):
        parser.error(f"--from-root: no warm start at {model_dir}")
    else:
      model_dir = study.build_warm_start(args.config, {}, seed, build_root)
    row = record(args.config, typed, seed, model_dir, git_commit=args.built_at or study.git_commit())
    print(f"{name_of(args.config)} seed {seed}: {row}")
  shutil.rmtree(build_root, ignore_errors=True)

if __name__ == "__main__":
  main()
