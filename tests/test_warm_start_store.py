"""The studies' shipped warm starts: their files match the manifest, a study installs them, a study root
holding another warm start is refused, other settings build their own."""

import json

import pytest

from experiments import study, warm_start_store

CONFIG = "configs/default.py"


def test_every_shipped_warm_start_matches_its_digest():
  table = warm_start_store.manifest()
  assert sorted(table["default"]["seeds"]) == ["0", "1", "2", "3"]     # the studies' four seeds
  assert warm_start_store.check() == []
  # Recorded with the settings this commit's config gives, so a study of this config uses them.
  assert table["default"]["settings"] == warm_start_store.settings(study.load_config(CONFIG, {}, 0))


def test_a_study_installs_the_shipped_warm_start(tmp_path):
  model_dir = study.shared_warm_start(CONFIG, {"trainer.steps": 300}, 1, str(tmp_path))
  assert model_dir == str(tmp_path / "_warm_start" / "seed1" / "model")
  assert study.digest(model_dir) == warm_start_store.manifest()["default"]["seeds"]["1"]["digest"]
  assert study.shared_warm_start(CONFIG, {}, 1, str(tmp_path)) == model_dir        # installed once, reused


def _fake_model(directory, payload: bytes):
  directory.mkdir(parents=True)
  (directory / "model.safetensors").write_bytes(payload)
  (directory / "config.json").write_text("{}")
  return str(directory)


def test_record_lookup_install_and_refusals(tmp_path):
  store, typed = str(tmp_path / "store"), study.load_config(CONFIG, {}, 0)
  built = _fake_model(tmp_path / "built", b"weights of seed 0")
  row = warm_start_store.record(CONFIG, typed, 0, built, git_commit="abc", store=store)
  assert row["digest"] == study.digest(built) and row["git_commit"] == "abc"
  assert json.load(open(tmp_path / "store" / "manifest.json"))["default"]["seeds"]["0"] == row
  # Installed into an empty root; found again in a root that holds the same files.
  target = str(tmp_path / "root" / "_warm_start" / "seed0" / "model")
  assert warm_start_store.install(CONFIG, typed, 0, target, store=store) == row["digest"]
  assert study.digest(target) == row["digest"]
  assert warm_start_store.install(CONFIG, typed, 0, target, store=store) == row["digest"]
  # Not shipped: another seed, or other warm-start settings (the study builds its own).
  assert warm_start_store.lookup(CONFIG, typed, 1, store=store) is None
  other = study.load_config(CONFIG, {"warm_start.steps": 7}, 0)
  assert warm_start_store.lookup(CONFIG, other, 0, store=store) is None
  with pytest.raises(ValueError, match="settings changed since its warm starts were recorded"):
    warm_start_store.record(CONFIG, other, 0, built, git_commit="abc", store=store)
  # A root that already holds another warm start is refused: its runs would not pair.
  elsewhere = _fake_model(tmp_path / "elsewhere" / "_warm_start" / "seed0" / "model", b"built on another CPU")
  with pytest.raises(ValueError, match="another warm start .* than the shipped one for default seed 0"):
    warm_start_store.install(CONFIG, typed, 0, elsewhere, store=store)
  # A shipped file changed: refused by lookup, named by check.
  (tmp_path / "store" / "default" / "seed0" / "model.safetensors").write_bytes(b"edited")
  with pytest.raises(ValueError, match="restore it from git"):
    warm_start_store.lookup(CONFIG, typed, 0, store=store)
  assert warm_start_store.check(store=store) == ["default seed 0"]


def test_runs_from_another_warm_start_are_run_again_and_kept_aside(tmp_path, monkeypatch):
  """`replace_other_warm_starts`: a run without the shipped digest runs again; the earlier one is kept."""
  before_digests = {"final_eval_accuracy": 0.4, "eval_curve": [[0, 0.3]]}
  from_shipped = {"final_eval_accuracy": 0.6, "eval_curve": [[0, 0.5]], "warm_start": "shipped0"}
  out, root = tmp_path / "results.json", tmp_path / "root"
  out.write_text(json.dumps({"cells": {"a": {"overrides": {}, "runs": {"0": before_digests}},
                                       "b": {"overrides": {}, "runs": {"0": from_shipped}}}}))
  (root / "a" / "seed0").mkdir(parents=True)
  (root / "a" / "seed0" / "metrics.jsonl").write_text("the earlier run's rows\n")
  ran = []
  monkeypatch.setattr(study, "shipped_digest", lambda config, common, seed: f"shipped{seed}")
  monkeypatch.setattr(study, "shared_warm_start", lambda config, common, seed, root: f"{root}/_warm_start")
  monkeypatch.setattr(study, "digest", lambda directory: "shipped0")
  monkeypatch.setattr(study, "_run_on", lambda *args: ran.append(args[4]))          # args[4]: the workdir
  monkeypatch.setattr(study, "summarise", lambda workdir, target: {"final_eval_accuracy": 0.7})
  monkeypatch.setattr(study, "aggregate", lambda runs: {})
  cells = [study.Cell("a", {}), study.Cell("b", {})]
  kwargs = dict(config=CONFIG, root=str(root), out=str(out), share_servers=False)
  assert study.run(cells, [0], **kwargs)["cells"]["a"]["runs"]["0"] == before_digests    # off: read, not run
  assert ran == []
  results = study.run(cells, [0], **kwargs, replace_other_warm_starts=True)
  assert ran == [str(root / "a" / "seed0")]
  assert results["cells"]["a"]["runs"]["0"]["warm_start"] == "shipped0"
  assert results["cells"]["a"]["superseded_runs"] == {"0": [before_digests]}
  assert results["cells"]["b"]["runs"]["0"] == from_shipped and "superseded_runs" not in results["cells"]["b"]
  assert (root / "a" / "seed0.superseded" / "metrics.jsonl").read_text() == "the earlier run's rows\n"
  assert json.loads(out.read_text())["cells"] == json.loads(json.dumps(results["cells"]))


def test_resummarise_records_the_warm_start_a_run_named(tmp_path, monkeypatch):
  """Runs from before digests get the digest of the warm start their resolved config names."""
  model = _fake_model(tmp_path / "root" / "_warm_start" / "seed0" / "model", b"weights")
  workdir = tmp_path / "root" / "a" / "seed0"
  workdir.mkdir(parents=True)
  (workdir / "summary.json").write_text("{}")
  (workdir / "stdout.log").write_text("python 3\nconfig (resolved): " + json.dumps(
      {"model": {"checkpoint": model}}) + "\n")
  monkeypatch.setattr(study, "summarise", lambda workdir, target: {"final_eval_accuracy": 0.7})
  monkeypatch.setattr(study, "aggregate", lambda runs: {})
  results = {"target_accuracy": 0.8, "cells": {"a": {"runs": {"0": {"final_eval_accuracy": 0.7}}}}}
  assert study.resummarise(results, str(tmp_path / "root"))["cells"]["a"]["runs"]["0"]["warm_start"] == \
      study.digest(model)
  (workdir / "stdout.log").write_text("config (resolved): " + json.dumps({"model": {"checkpoint": "tiny"}}))
  assert study.warm_start_of(str(workdir)) is None
