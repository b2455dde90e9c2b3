"""Run a study: a grid of config overrides × seeds, each cell a run of the main job; aggregate; render.

    from experiments import study
    cells = [study.Cell("copc_k16", {"preset": "copc_spec", "trainer.mode": "lag", "trainer.lag": 16}), ...]
    results = study.run(cells, seeds=[0, 1, 2], config="configs/default.py", root=WORKDIRS,
                        out="experiments/<study>/results.json", common={"trainer.steps": 100})
    study.render(results, "experiments/<study>")     # table in README.md, figures as PNG

- Every cell × seed is `python -m copc_jax.main --config=... --config.seed=S --config.<k>=<v>` in its
  own process and workdir (`root/<cell>/seed<S>`).
- One warm start per seed, shared by every cell (`root/_warm_start/seed<S>`): the one shipped in the
  repository for the config's settings (`warm_start_store`: cells run in other sessions, on other CPUs,
  still begin from the same weights), else built once by `warm_start.prepare`. Every run records the
  digest of the warm start it began from.
- Resumable: a cell × seed already in the results JSON, or whose `summary.json` exists, is not rerun;
  rerunning the command (with more seeds or cells, in a later session too) extends the study. The
  results JSON is rewritten after every cell.
- The JSON holds, per cell and seed, the curves and summary numbers of `summarise`, the aggregate
  (mean, std over seeds), and the provenance: git commit, jax version, resolved base config.

- The JetStream servers stay alive across cells (`SharedServers`, `share_servers=True`): each cell gets
  their addresses (`rollout.addresses`, and `rollout.eval_addresses` for lag mode's evaluation server)
  and its pool's first push starts the cell's own versions on them, so only the first cell waits for
  servers to start and compile. Sampling is keyed by each request's seed, so a cell's numbers are the
  same on shared or its own servers. A cell whose rollout settings differ starts its own; a server
  that dies is restarted before the next cell, and a cell that failed because of it is run again
  (it resumes from its last checkpoint).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
from scipy import stats

from copc_jax import config as config_lib
from copc_jax.envs.tasks import make_task
from copc_jax.rollout import auth
from copc_jax.rollout.process import ServerProcess
from copc_jax.train import metrics, trainer, warm_start
from copc_jax.train import workdir as workdir_lib
from experiments import figures, warm_start_store
from experiments.warm_start_store import digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Cell:
  name: str
  overrides: dict          # {"preset": "copc", "trainer.lag": 16, ...}: config fields (dotted) → values


CODE_PATHS = ("*.py", "pyproject.toml", "requirements*.txt", "setup.sh")   # what a run's numbers depend on


def git_commit() -> str:
  """HEAD, with "+uncommitted" where code differs from it (results, READMEs and figures a study writes
  as it goes do not count)."""
  out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
  dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
                         cwd=ROOT, capture_output=True, text=True).stdout.strip()
  return out + ("+uncommitted" if dirty else "")


def run_commits(results: dict) -> str:
  """The commits a grid's runs ran at (each run records its own; a grid filled over several sessions
  has several), most runs first: "commit c" or "commits c1 (n1 runs), c2 (n2 runs)"."""
  counts = collections.Counter(run["git_commit"][:10] for entry in results["cells"].values()
                               for run in entry["runs"].values() if run.get("git_commit"))
  if len(counts) <= 1:
    return f"commit {next(iter(counts), results['git_commit'][:10])}"
  return "commits " + ", ".join(f"{commit} ({n} run{'s' * (n > 1)})" for commit, n in counts.most_common())


def grid_provenance(results: dict) -> str:
  """A grid README's provenance: its runs' commits, the jax version and the machine."""
  return f"{run_commits(results)}, jax {results['jax_version']}, {results['machine']}"


def _config_path_and_arg(config: str, overrides: dict) -> str:
  """`configs/x.py[:preset]`: the preset goes in the config file's argument."""
  return f"{config}:{overrides['preset']}" if "preset" in overrides else config


def _flags(overrides: dict) -> list[str]:
  flags = []
  for key, value in overrides.items():
    if key == "preset":
      continue
    text = repr(tuple(value)) if isinstance(value, list | tuple) else str(value)
    flags.append(f"--config.{key}={text}")
  return flags


def load_config(config: str, overrides: dict, seed: int):
  """The typed config of a cell (for its warm start and the provenance)."""

  spec = importlib.util.spec_from_file_location("study_config", os.path.join(ROOT, config))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  raw = module.get_config(overrides.get("preset"))
  raw.seed = seed
  for key, value in overrides.items():
    if key != "preset":
      section, field = key.split(".")
      raw[section][field] = tuple(value) if isinstance(value, list) else value
  return config_lib.from_config_dict(raw)


def shared_warm_start(config: str, common: dict, seed: int, root: str) -> str | None:
  """The warm-started model of `seed` under `root/_warm_start` (None: the config has no warm start): the
  one shipped in the repository for these settings (`warm_start_store`), else built once there."""
  typed = load_config(config, common, seed)
  if not typed.warm_start.steps:
    return None
  model_dir = os.path.join(root, "_warm_start", f"seed{seed}", "model")
  if warm_start_store.install(config, typed, seed, model_dir) is not None:
    print(f"warm start: the shipped one of {warm_start_store.name_of(config)} seed {seed}", flush=True)
    return model_dir
  return build_warm_start(config, common, seed, root)


def build_warm_start(config: str, common: dict, seed: int, root: str) -> str:
  """The warm start of `seed` built (or reused) under `root/_warm_start/seed<S>` by `warm_start.prepare`."""
  typed = load_config(config, common, seed)
  directory = os.path.join(root, "_warm_start", f"seed{seed}")
  base = trainer.base_checkpoint(typed, directory)
  return warm_start.prepare(make_task(typed.task, seed), base, directory, typed.warm_start, seed=seed,
                            tokenizer_dir=trainer.tokenizer_dir(typed, base))


class SharedServers:
  """Rollout servers kept alive across the cells of a study: `num_servers` for training and one for
  lag mode's evaluations, with the rollout settings of the first cell that uses them."""

  def __init__(self, checkpoint: str, rollout, log_dir: str):
    self.checkpoint, self.rollout, self.log_dir = checkpoint, rollout, log_dir
    self.processes: list = [None] * (rollout.num_servers + 1)      # the last one evaluates
    self.starts = 0
    self.token = auth.new_token()          # the cells get it in their environment ($COPC_AUTH_TOKEN)

  @staticmethod
  def settings(rollout) -> tuple:
    return (rollout.num_servers, rollout.slots, rollout.max_prefill_length, rollout.max_length,
            rollout.server_platform, rollout.server_tensor_parallelism, rollout.server_data_parallelism,
            rollout.server_decode_steps, rollout.server_dtype)

  def fits(self, rollout) -> bool:
    return not rollout.addresses and self.settings(rollout) == self.settings(self.rollout)

  def dead(self) -> list[int]:
    return [i for i, p in enumerate(self.processes) if p is None or not p.alive()]

  def ensure_running(self) -> None:
    """Start every server that is not running (at first: all of them), and wait until they answer."""
    c = self.rollout
    dead = self.dead()
    for i in dead:
      if self.processes[i] is not None:
        print(f"shared server {i} died: restarting it", flush=True)
        self.processes[i].stop()
      os.makedirs(self.log_dir, exist_ok=True)
      self.processes[i] = ServerProcess(self.checkpoint, slots=c.slots, max_prefill_length=c.max_prefill_length,
                                        max_length=c.max_length, seed=i, version=-1, platform=c.server_platform,
                                        tensor_parallelism=c.server_tensor_parallelism,
                                        data_parallelism=c.server_data_parallelism,
                                        decode_steps=c.server_decode_steps, dtype=c.server_dtype,
                                        token=self.token,
                                        log_path=os.path.join(self.log_dir, f"server_{i}.log"))
      self.starts += 1
    for i in dead:
      self.processes[i].wait_ready(c.ready_timeout_s)

  def overrides(self) -> dict:
    addresses = [p.address for p in self.processes]
    return {"rollout.addresses": tuple(addresses[:-1]), "rollout.eval_addresses": (addresses[-1],)}

  def close(self) -> None:
    for process in self.processes:
      if process is not None:
        process.stop()


def run_cell(config: str, overrides: dict, seed: int, workdir: str, warm_model: str | None,
             token: str | None = None) -> None:
  """One cell × seed as its own process; `token`: the shared servers' (in its environment)."""
  command = [sys.executable, "-m", "copc_jax.main", f"--config={_config_path_and_arg(config, overrides)}",
             f"--workdir={workdir}", f"--config.seed={seed}", "--config.trainer.progress_bar=False",
             *_flags(overrides)]
  if warm_model is not None:   # the shared warm start replaces this run's own
    command += [f"--config.model.checkpoint={warm_model}", "--config.warm_start.steps=0"]
  if workdir_lib.previous_history(workdir):     # a cell killed before its first checkpoint: start it over
    command += ["--fresh_start"]
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "stdout.log"), "a") as log:
    subprocess.run(command, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT,
                   env={**os.environ, "XLA_FLAGS": "", **({"COPC_AUTH_TOKEN": token} if token else {})})


def same_warm_start(a: dict, b: dict) -> bool:
  """Whether two runs of a seed began from one warm start: the same digest where both recorded it,
  else the same held-out accuracy at update 0 (the studies before digests; a greedy evaluation of the
  warm start itself)."""
  if a.get("warm_start") and b.get("warm_start"):
    return a["warm_start"] == b["warm_start"]
  return a["eval_curve"][0] == b["eval_curve"][0]


def summarise(workdir: str, target: float) -> dict:
  """One run's numbers: the held-out curve, final accuracy, AUC, peak-to-final drop, updates to `target`."""
  rows = metrics.read_metrics(workdir)
  curve = [(r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
  updates = metrics.update_rows(rows)
  steps, accuracy = np.array([s for s, _ in curve], float), np.array([a for _, a in curve], float)
  reached = [s for s, a in curve if a >= target]
  mean_of = lambda key: float(np.mean([r[key] for r in updates if r.get(key) is not None] or [np.nan]))
  warmup = [r for r in rows if "critic_warmup_step" in r]
  return {
      "eval_curve": curve,
      "final_eval_accuracy": float(accuracy[-1]),
      # Mean held-out accuracy over the run: the area under the curve / the number of updates.
      "auc": float(np.trapezoid(accuracy, steps) / max(steps[-1] - steps[0], 1)),
      "peak_to_final_drop": float(accuracy.max() - accuracy[-1]),
      "updates_to_target": reached[0] if reached else None,
      "mask_fraction_mean": mean_of("mask_fraction"), "ess_mean": mean_of("ess"),
      "staleness_mean": mean_of("staleness_mean"), "reward_last_10": float(np.mean(
          [r["reward_mean"] for r in updates[-10:]])),
      # as the trainer reports it: the mean over the warm-up's last 3 batches whose targets vary
      "critic_warmup_explained_variance": _mean_or_none([r["value_explained_variance"] for r in warmup[-3:]]),
      "series": {key: [r.get(key) for r in updates] for key in SERIES_KEYS},
  }


def _mean_or_none(values) -> float | None:
  finite = [v for v in values if v is not None and -1e3 < v <= 1]     # older rows: degenerate batches
  return float(np.mean(finite)) if finite else None


# What the rows keep of each update, for the studies (what moves before a failure included).
SERIES_KEYS = ("reward_mean", "mask_fraction", "ess", "grad_norm", "staleness_mean", "entropy",
               "advantage_raw_mean", "advantage_raw_std", "advantage_raw_min", "advantage_raw_max",
               "returns_mean", "value_loss", "value_explained_variance", "clip_fraction", "kl_behavior",
               "ratio_min", "ratio_max", "ratio_p99", "actor_update_norm", "inside_first_lag")


def spread(values) -> dict | None:
  """Mean, sample std (n − 1), the half-width of the 95% t interval of the mean, min, max and count of
  `values` (None if there are none; std and interval None for a single value)."""
  values = np.asarray(values, float)
  if not values.size:
    return None
  n = int(values.size)
  std = float(values.std(ddof=1)) if n > 1 else None
  half = float(stats.t.ppf(0.975, n - 1) * std / np.sqrt(n)) if n > 1 else None
  return {"mean": float(values.mean()), "std": std, "ci95": half, "min": float(values.min()),
          "max": float(values.max()), "n": n}


def fisher_collapses(collapsed_a: int, n_a: int, collapsed_b: int, n_b: int) -> float:
  """Two-sided Fisher exact test p-value of two collapse counts (collapsed of n seeds)."""
  return float(stats.fisher_exact([[collapsed_a, n_a - collapsed_a], [collapsed_b, n_b - collapsed_b]])[1])


def aggregate(per_seed: dict[int, dict]) -> dict:
  """`spread` over seeds of each scalar (updates_to_target: over the seeds that reached it)."""
  return {key: spread([r[key] for r in per_seed.values() if r.get(key) is not None])
          for key in ("final_eval_accuracy", "auc", "peak_to_final_drop", "updates_to_target",
                      "mask_fraction_mean", "ess_mean", "staleness_mean", "reward_last_10")}


def provenance() -> dict:
  return {"jax_version": jax.__version__, "python": platform.python_version(),
          "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}


def run(cells: list[Cell], seeds: list[int], *, config: str, root: str, out: str, common: dict | None = None,
        target: float = 0.8, description: str = "", share_servers: bool = True,
        replace_other_warm_starts: bool = False) -> dict:
  """Run (or read) every cell × seed and write the results JSON after each; returns it.

  `replace_other_warm_starts`: a run in the JSON that did not begin from the seed's shipped warm start
  (`warm_start_store`; another digest, or none recorded) is run again from it; the earlier run moves to
  the cell's `superseded_runs` and its workdir to `<workdir>.superseded`, so nothing measured is lost."""
  servers: list[SharedServers] = []
  try:
    return _run(cells, seeds, config, root, out, dict(common or {}), target, description,
                servers if share_servers else None, replace_other_warm_starts)
  finally:
    for each in servers:
      each.close()


def _run_on(servers: list[SharedServers] | None, config: str, overrides: dict, seed: int, workdir: str,
            warm_model: str | None, root: str) -> None:
  """One cell on the shared servers where its rollout settings allow (else on its own)."""
  rollout = load_config(config, overrides, seed).rollout
  if servers is None or (servers and not servers[0].fits(rollout)):
    run_cell(config, overrides, seed, workdir, warm_model)
    return
  if not servers:
    servers.append(SharedServers(warm_model or trainer_base(config, overrides, seed, root), rollout,
                                 os.path.join(root, "_servers")))
  shared = servers[0]
  shared.ensure_running()
  try:
    run_cell(config, {**overrides, **shared.overrides()}, seed, workdir, warm_model, shared.token)
  except subprocess.CalledProcessError:
    if not shared.dead():
      raise
    shared.ensure_running()         # a server died under the cell: run it again (it resumes)
    run_cell(config, {**overrides, **shared.overrides()}, seed, workdir, warm_model, shared.token)


def trainer_base(config: str, overrides: dict, seed: int, root: str) -> str:
  """The base checkpoint of a study without warm start (its servers start from it)."""
  return trainer.base_checkpoint(load_config(config, overrides, seed), os.path.join(root, "_base"))


REPLACE_HELP = ("run again, from the seed's shipped warm start (experiments/warm_starts), every run in the "
                "JSON that began from another; the earlier runs stay in the JSON as superseded_runs")


def shipped_digest(config: str, common: dict, seed: int) -> str:
  """The digest of the warm start shipped for `config` and `seed` (an error naming the command that
  records one, where none is)."""
  shipped = warm_start_store.lookup(config, load_config(config, common, seed), seed)
  if shipped is None:
    raise ValueError(f"no shipped warm start for {config} seed {seed} with these settings; record one with "
                     f"python -m experiments.warm_start_store --config {config} --seeds {seed}")
  return shipped[1]


def _supersede(entry: dict, seed: int, workdir: str) -> None:
  """Move a seed's earlier run of a cell aside (JSON and workdir) so that it runs again."""
  entry.setdefault("superseded_runs", {}).setdefault(str(seed), []).append(entry["runs"].pop(str(seed)))
  if os.path.exists(workdir):
    shutil.rmtree(f"{workdir}.superseded", ignore_errors=True)
    os.rename(workdir, f"{workdir}.superseded")


def copy_identical_runs(out: str, config: str, common: dict, cell: Cell, source: str, source_cell: str,
                        *, seeds) -> list[int]:
  """Copy into the study JSON `out` the runs of `seeds` that another study (`source`, a results JSON of
  the same `config`) measured in `source_cell`, where the two cells resolve to the *same* typed config
  for that seed (each copied run says where it came from: `copied_from`); `run` then reads them instead
  of running them again. A seed whose configs differ, or that `cell` already holds, is left alone.
  Returns the seeds copied."""
  if not os.path.exists(source):
    return []
  with open(source) as f:
    theirs = json.load(f)
  if theirs["config"] != config or source_cell not in theirs["cells"]:
    return []
  results = {"cells": {}}
  if os.path.exists(out):
    with open(out) as f:
      results = json.load(f)
  entry = results["cells"].setdefault(cell.name, {"overrides": {**common, **cell.overrides}, "runs": {}})
  copied = []
  for seed in seeds:
    run = theirs["cells"][source_cell]["runs"].get(str(seed))
    if run is None or str(seed) in entry["runs"]:
      continue
    if load_config(config, entry["overrides"], seed) != load_config(
        config, theirs["cells"][source_cell]["overrides"], seed):
      print(f"{cell.name} seed {seed}: {source_cell} of {os.path.relpath(source, ROOT)} resolves to another "
            "config; not copied", flush=True)
      continue
    entry["runs"][str(seed)] = {**run, "copied_from": f"{os.path.relpath(source, ROOT)}: {source_cell}"}
    copied.append(seed)
  if copied:
    entry["aggregate"] = aggregate(entry["runs"])
    write_json(out, results)
  return copied


def _run(cells, seeds, config, root, out, common, target, description, servers, replace_other) -> dict:
  results = {"description": description, "config": config, "common_overrides": common, "seeds": seeds,
             "target_accuracy": target, "git_commit": git_commit(), "jax_version": jax.__version__,
             "python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
             "base_config": json.loads(json.dumps(dataclasses.asdict(load_config(config, common, seeds[0])),
                                                  default=str)),
             "cells": {}}
  if os.path.exists(out):     # keep what an earlier invocation measured (its commit stays on the cell)
    with open(out) as f:
      results["cells"] = json.load(f).get("cells", {})
  for seed in seeds:
    warm_model = None
    wanted = shipped_digest(config, common, seed) if replace_other else None
    for cell in cells:
      workdir = os.path.join(root, cell.name, f"seed{seed}")
      entry = results["cells"].setdefault(cell.name, {"overrides": {**common, **cell.overrides}, "runs": {}})
      if str(seed) in entry["runs"]:
        if wanted is None or entry["runs"][str(seed)].get("warm_start") == wanted:
          continue        # measured before (this session or an earlier one): the JSON is the record
        _supersede(entry, seed, workdir)
      if warm_model is None:
        warm_model = shared_warm_start(config, common, seed, root) or ""
        warm_digest = {"warm_start": digest(warm_model)} if warm_model else {}
      if not os.path.exists(os.path.join(workdir, "summary.json")):
        start = time.time()
        print(f"[{time.strftime('%H:%M:%S')}] {cell.name} seed {seed}", flush=True)
        _run_on(servers, config, {**common, **cell.overrides}, seed, workdir, warm_model or None, root)
        entry["runs"][str(seed)] = {**summarise(workdir, target), "wall_time_s": time.time() - start,
                                    "git_commit": results["git_commit"], **warm_digest}
      else:
        entry["runs"][str(seed)] = {**summarise(workdir, target), "git_commit": results["git_commit"],
                                    **warm_digest}
      entry["aggregate"] = aggregate(entry["runs"])
      write_json(out, results)
  return results


def resummarise(results: dict, root: str) -> dict:
  """Every run whose workdir is still under `root` summarised again from its rows by this commit's
  `summarise` (what a run measured does not change; what the study derives from its rows may), with the
  digest of its warm start where it ran before runs recorded one (`warm_start_of`)."""
  for name, entry in results["cells"].items():
    for seed, run in entry["runs"].items():
      workdir = os.path.join(root, name, f"seed{seed}")
      if os.path.exists(os.path.join(workdir, "summary.json")):
        run = entry["runs"][seed] = {**run, **summarise(workdir, results["target_accuracy"])}
        if not run.get("warm_start") and (began_from := warm_start_of(workdir)):
          run["warm_start"] = began_from
    entry["aggregate"] = aggregate(entry["runs"])
  return results


def warm_start_of(workdir: str) -> str | None:
  """The digest of the warm start a run's resolved config names (`model.checkpoint`, first line of its
  stdout.log that prints the config), as that directory is now; None where it names none or it is gone.
  Right unless the study root's warm start was built again after the run."""
  with open(os.path.join(workdir, "stdout.log")) as f:
    line = next((line for line in f if line.startswith("config (resolved): ")), None)
  if line is None:
    return None
  checkpoint_dir = json.loads(line.removeprefix("config (resolved): "))["model"]["checkpoint"]
  return digest(checkpoint_dir) if os.path.isfile(os.path.join(checkpoint_dir, "config.json")) else None


def write_benchmark(path: str, results: dict) -> None:
  """A benchmark's `results` as JSON, with the command, commit and machine that produced them."""
  write_json(path, {**results, "command": command_line(), "git_commit": git_commit(),
                    **provenance()})


def command_line() -> str:
  """This process's command as a user types it from the repository root (`python -m experiments.<name> ...`)."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  program = ["-m", spec.name] if spec is not None and spec.name else [os.path.relpath(sys.argv[0], ROOT)]
  return " ".join(["python", *program, *sys.argv[1:]])


def beside(script: str, suffix: str = ".json") -> str:
  """Where a benchmark keeps its results: beside its script, under the script's name
  (`experiments/bench_rollout.py` -> `experiments/bench_rollout.json`)."""
  return os.path.splitext(os.path.abspath(script))[0] + suffix


def json_text(value, level: int = 0) -> str:
  """JSON indented one space per level, except that a list holding no object (a run's series, an
  evaluation curve) stays on one line: a study's file reads as its structure, not as one number a line."""
  pad, end = " " * (level + 1), "\n" + " " * level
  if isinstance(value, dict) and value:
    items = [f"{pad}{json.dumps(str(k))}: {json_text(v, level + 1)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + end + "}"
  if isinstance(value, (list, tuple)) and any(isinstance(v, dict) for v in value):
    return "[\n" + ",\n".join(pad + json_text(v, level + 1) for v in value) + end + "]"
  return json.dumps(value)


def write_json(path: str, value) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    f.write(json_text(value) + "\n")
  os.replace(path + ".tmp", path)


# --- rendering: tables and figures from the JSON, never typed by hand -----------------------------------

def fmt(stat, digits=3) -> str:
  """mean ± half-width of the 95% interval over seeds (mean alone for one seed)."""
  if stat is None:
    return "–"
  if "ci95" not in stat:            # JSON of the studies before intervals: population std, as rendered then
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"
  if stat["ci95"] is None:
    return f"{stat['mean']:.{digits}f}"
  return f"{stat['mean']:.{digits}f} ± {stat['ci95']:.{digits}f}"


def paired_difference(results: dict, name: str, reference: str, key: str = "final_eval_accuracy"):
  """`spread` over the seeds both cells ran from one warm start (`same_warm_start`) of (cell − reference):
  seeds differ far more than methods, and every cell of a seed starts from that seed's warm start."""
  runs, ref = results["cells"][name]["runs"], results["cells"][reference]["runs"]
  values = [runs[s][key] - ref[s][key] for s in runs if s in ref and same_warm_start(runs[s], ref[s])]
  stored = results["cells"][name].get("aggregate", {}).get(key)
  if stored is not None and "ci95" not in stored and values:   # a study run before intervals: as then
    return {"mean": float(np.mean(values)), "std": float(np.std(values)), "n": len(values)}
  return spread(values)


INF = float("inf")
# Candidate COPC settings (config overrides of the spec's setting) that the studies run by name next to
# the presets: the joint sweep's best RL cell at k = 16 (no token mask, no ρ clip, traces truncated at
# 1), and that plus the exact-MDP toy's best advantage form (λ = 0.8, `vtrace_pg`).
_NOMASK = {"preset": "copc_spec", "actor.mask_range": (0.0, INF), "estimator.rho_clip": (0.0, INF),
           "estimator.trace_clip": (0.0, 1.0)}
CANDIDATES = {"copc_nomask": _NOMASK, "copc_nomask_vtrace_pg": {**_NOMASK, "estimator.lam": 0.8,
                                                                 "estimator.advantage_form": "vtrace_pg"}}
# Settings the reruns on the new learner run by name: the spec's COPC (a study's `copc` cells are the spec's
# setting, whatever the `copc` preset's current pick), COPC μ-anchored (the collapse diagnosis's stable
# reading) and the group presets at 4 samples per prompt.
VARIANTS = {"copc": {"preset": "copc_spec"},
            "copc_anchor_behavior": {"preset": "copc_spec", "actor.anchor": "behavior"},
            **{group: {"preset": group, "trainer.group_size": 4} for group in ("grpo", "dr_grpo", "rloo")}}
# The presets every rerun compares, at k = 64 and 16 against sync PPO at k = 0, 4 seeds, 300 updates.
RERUN_PRESETS = ("async_ppo", "decoupled_ppo", "copc", "copc_anchor_behavior", "vtrace", "tis", "icepop",
                 "grpo", "dr_grpo", "rloo")


def named_setting(name: str) -> dict:
  """The overrides a grid's cell name stands for: a COPC candidate, a variant, or a preset by its name."""
  return CANDIDATES.get(name, VARIANTS.get(name, {"preset": name}))


COLLAPSE_DROP = 0.2


def collapse_step(curve, drop: float = COLLAPSE_DROP) -> int | None:
  """The first evaluation at which held-out accuracy is more than `drop` below its running maximum and
  stays there to the end of the run (a collapse that does not recover), or None."""
  for i, (step, accuracy) in enumerate(curve):
    peak = max(a for _, a in curve[:i + 1])
    if accuracy < peak - drop and all(a < peak - drop for _, a in curve[i:]):
      return int(step)
  return None


def _collapses(entry: dict) -> str:
  steps = [collapse_step(run["eval_curve"]) for run in entry["runs"].values()]
  at = sorted(s for s in steps if s is not None)
  return f"{len(at)}/{len(steps)}" + (f" (at {', '.join(map(str, at))})" if at else "")


def table(results: dict, cells: list[str] | None = None, reference: str | None = None) -> str:
  """Markdown: one row per cell, mean ± std over seeds (and the paired difference to `reference`)."""
  paired = f" final − {reference} (paired) |" if reference else ""
  lines = [f"| cell | seeds | final accuracy |{paired} AUC | peak → final drop | updates to "
           f"{results['target_accuracy']:.2f} (seeds that reached it) | collapsed (seeds) | mask fraction | "
           "ESS | staleness |",
           "|---|---:|---:|" + ("---:|" if reference else "") + "---:|---:|---:|---:|---:|---:|---:|"]
  for name in cells or results["cells"]:
    entry = results["cells"][name]
    a = entry["aggregate"]
    reached = a["updates_to_target"]
    to_target = "–" if reached is None else f"{reached['mean']:.0f} ({reached['n']}/{len(entry['runs'])})"
    difference = f" {fmt(paired_difference(results, name, reference))} |" if reference else ""
    lines.append(f"| {name} | {len(entry['runs'])} | {fmt(a['final_eval_accuracy'])} |{difference} "
                 f"{fmt(a['auc'])} | {fmt(a['peak_to_final_drop'])} | {to_target} | {_collapses(entry)} | "
                 f"{fmt(a['mask_fraction_mean'], 4)} | {fmt(a['ess_mean'])} | "
                 f"{fmt(a['staleness_mean'], 1)} |")
  return "\n".join(lines)


def best_baseline(results: dict, names: list[str]) -> str | None:
  """Of `names` (cells that ran), the one with the highest mean final accuracy: the bar a method must
  clear at that setting."""
  ran = [n for n in names if results["cells"].get(n, {}).get("runs")]
  return max(ran, key=lambda n: results["cells"][n]["aggregate"]["final_eval_accuracy"]["mean"], default=None)


def comparison_table(results: dict, cells: list[str], reference: str, baseline: str | None) -> str:
  """Markdown: one row per cell, mean ± 95% t interval over seeds, the paired differences against
  `reference` and against `baseline` (final accuracy), and the collapse count with its two-sided Fisher
  p against `baseline`'s."""
  def collapsed(name):
    runs = results["cells"][name]["runs"].values()
    return sum(collapse_step(r["eval_curve"]) is not None for r in runs), len(runs)

  b = baseline or "best baseline"
  lines = [f"| cell | seeds | final accuracy | − {reference} (paired) | − {b} (paired) | AUC | "
           f"peak → final drop | collapsed | Fisher p vs {b} | mask fraction | ESS |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for name in cells:
    entry = results["cells"].get(name)
    if not entry or not entry["runs"]:
      continue
    a = entry["aggregate"]
    def against(other, name=name):
      ran = other is not None and other != name and results["cells"].get(other, {}).get("runs")
      return fmt(paired_difference(results, name, other)) if ran else "–"

    p = "–"
    if baseline and baseline != name:
      p = f"{fisher_collapses(*collapsed(name), *collapsed(baseline)):.2f}"
    lines.append(f"| {name} | {len(entry['runs'])} | {fmt(a['final_eval_accuracy'])} | {against(reference)} | "
                 f"{against(baseline)} | {fmt(a['auc'])} | {fmt(a['peak_to_final_drop'])} | "
                 f"{_collapses(entry)} | {p} | {fmt(a['mask_fraction_mean'], 4)} | {fmt(a['ess_mean'])} |")
  return "\n".join(lines)


EARLY_UPDATES = 25     # the windows of `early_signs_table` (the reruns collapse by update 25-75)
LATE_UPDATES = 50


def _range(values, digits: int = 3) -> str:
  """lowest–highest of the seeds' values ("–" if none)."""
  values = [v for v in values if v is not None]
  if not values:
    return "–"
  zero = f"{0:.{digits}f}"
  low, high = (f"{v:.{digits}f}".replace(f"-{zero}", zero) for v in (min(values), max(values)))   # no "-0.000"
  return low if low == high else f"{low}–{high}"


def early_signs_table(results: dict, cells: list[str]) -> str:
  """Markdown: what moves before a collapse, one row per cell, each entry the range over seeds
  (lowest–highest) of a run's mean over a window of updates: KL(μ‖π) (k3, from μ's log-probs) and the
  policy's entropy over updates 1–25 and over the last 50, and the PPO clip fraction over updates 1–25
  (the run's mean and its largest single update)."""
  e, late = EARLY_UPDATES, LATE_UPDATES
  columns = [("kl_behavior", 0, e, np.mean), ("kl_behavior", -late, None, np.mean),
             ("entropy", 0, e, np.mean), ("entropy", -late, None, np.mean),
             ("clip_fraction", 0, e, np.mean), ("clip_fraction", 0, e, np.max)]
  lines = [f"| cell | seeds | KL(μ‖π), updates 1–{e} | KL(μ‖π), last {late} | entropy, updates 1–{e} | "
           f"entropy, last {late} | clip fraction, updates 1–{e} | clip fraction, largest in 1–{e} |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for name in cells:
    runs = list(results["cells"].get(name, {}).get("runs", {}).values())
    if not runs:
      continue
    entries = []
    for key, start, stop, reduce in columns:
      per_seed = []
      for run in runs:
        window = [v for v in run.get("series", {}).get(key, [])[start:stop] if v is not None]
        per_seed.append(float(reduce(window)) if window else None)
      entries.append(_range(per_seed))
    lines.append(f"| {name} | {len(runs)} | " + " | ".join(entries) + " |")
  return "\n".join(lines)


def render_by_lag(results: dict, readme: str, marker: str, figure: str) -> None:
  """The reruns' rendering: one comparison table per lag (95% intervals, paired differences against
  the k = 0 reference `sync_ppo_k0` and the best non-COPC baseline at that lag, Fisher tests of collapse
  counts), each lag's `early_signs_table`, and the curves figure (`figure`, beside
  `readme`), between `marker`'s markers."""
  lags = sorted({c["overrides"]["trainer.lag"] for c in results["cells"].values()
                 if c["overrides"].get("trainer.lag")}, reverse=True)
  groups, tables = {}, []
  for lag in lags:
    names = [n for n, c in results["cells"].items() if c["overrides"].get("trainer.lag") == lag]
    baseline = best_baseline(results, [n for n in names if not n.startswith("copc")])
    groups[f"k = {lag} (sync PPO: k = 0)"] = ["sync_ppo_k0", *names]
    tables.append(f"**k = {lag}** (best baseline: {baseline or 'none run yet'})\n\n"
                  + comparison_table(results, ["sync_ppo_k0", *names], "sync_ppo_k0", baseline))
    tables.append(f"What moves before a collapse at k = {lag} (range over seeds of each run's mean over the "
                  f"window):\n\n" + early_signs_table(results, ["sync_ppo_k0", *names]))
  curves_figure(results, os.path.join(os.path.dirname(readme), figure), groups)
  seeds = sorted({int(s) for c in results["cells"].values() for s in c["runs"]})
  text = (f"Grid so far: {sum(bool(c['runs']) for c in results['cells'].values())} cells, seeds {seeds}, "
          f"{results['common_overrides'].get('trainer.steps')} updates per run; "
          f"{grid_provenance(results)}. "
          "Mean ± half-width of the 95% t interval over seeds; paired differences per seed, over the seeds "
          "both cells ran from one warm start." + warm_start_note(results) + "\n\n"
          + "\n\n".join(tables) + f"\n\n![held-out accuracy curves]({figure})")
  write_between_markers(readme, marker, text)


def warm_start_note(results: dict) -> str:
  """A sentence naming the runs whose seed's warm start differs from the seed's first run's (a warm
  start built again, on another CPU): their cells pair with the others only over the remaining seeds."""
  first, apart = {}, {}
  for name, entry in results["cells"].items():
    for seed, run in sorted(entry["runs"].items()):
      if not same_warm_start(first.setdefault(seed, run), run):
        apart.setdefault(name, []).append(seed)
  if not apart:
    return ""
  runs = "; ".join(f"{name} seed{'s' * (len(seeds) > 1)} {', '.join(seeds)}" for name, seeds in apart.items())
  return (f" From another warm start than the rest of their seed (built again on another CPU; held-out "
          f"accuracy at update 0 differs), so not paired with them: {runs}.")


def curves_figure(results: dict, path: str, groups: dict[str, list[str]]) -> None:
  """Small multiples of held-out accuracy against updates: one row per group, one panel per cell after the
  group's first (its reference, drawn dashed in every panel of the row); thin lines are seeds, the thick
  line their mean, in the preset's colour (`figures.color_of`)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def runs_of(name):
    return [dict(map(tuple, r["eval_curve"])) for r in results["cells"].get(name, {}).get("runs", {}).values()]

  def draw(ax, name, reference=False):
    curves = runs_of(name)
    if not curves:
      return
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    values = np.array([[c[s] for s in steps] for c in curves])
    color = "0.55" if reference else figures.color_of(name)
    if not reference:
      for row in values:
        ax.plot(steps, row, color=color, lw=0.6, alpha=0.45)
    ax.plot(steps, values.mean(0), color=color, lw=1.3 if reference else 2.0, ls="--" if reference else "-",
            label=f"{name} (mean of {len(curves)})")

  rows = {title: (names[0], [n for n in names[1:] if runs_of(n)]) for title, names in groups.items()}
  rows = {title: row for title, row in rows.items() if row[1]}
  columns = max([len(cells) for _, cells in rows.values()], default=1)
  fig, axes = plt.subplots(max(len(rows), 1), columns, figsize=(2.6 * columns, 2.3 * max(len(rows), 1)),
                           sharex=True, sharey=True, squeeze=False)
  for ax in axes.flat:
    ax.set_visible(False)
  for row, (title, (reference, cells)) in zip(axes, rows.items()):
    for ax, name in zip(row, cells):
      ax.set_visible(True)
      draw(ax, reference, reference=True)
      draw(ax, name)
      ax.set_title(f"{name}", fontsize=8, color=figures.color_of(name))
      ax.tick_params(labelsize=7)
      ax.grid(alpha=0.3)
    row[0].set_ylabel(f"{title}\nheld-out accuracy", fontsize=7)
  for ax in axes[-1]:
    ax.set_xlabel("update", fontsize=7)
  handles = [matplotlib.lines.Line2D([], [], color="0.55", ls="--", label="reference (first cell of the row)"),
             matplotlib.lines.Line2D([], [], color="0.3", lw=2.0, label="cell: mean over seeds"),
             matplotlib.lines.Line2D([], [], color="0.3", lw=0.6, alpha=0.6, label="cell: one seed")]
  fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=7, frameon=False,
             bbox_to_anchor=(0.5, 0.0))
  fig.tight_layout(rect=(0, 0.05, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def figure_file(stem: str, name: str) -> str:
  """The figure a rendering named `name` draws: `stem.png` for `results`, `stem_rerun.png` for
  `results_rerun`, `stem_<name>.png` for any other name."""
  return f"{stem}.png" if name == "results" else f"{stem}_{name.removeprefix('results_')}.png"


def write_between_markers(path: str, name: str, text: str) -> None:
  """Replace what lies between `<!-- name:begin -->` and `<!-- name:end -->` in `path`."""
  with open(path) as f:
    content = f.read()
  begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
  if begin not in content or end not in content:
    raise ValueError(f"{path} has no {begin} … {end} markers")
  head, rest = content.split(begin, 1)
  _, tail = rest.split(end, 1)
  with open(path, "w") as f:
    f.write(f"{head}{begin}\n{text}\n{end}{tail}")
