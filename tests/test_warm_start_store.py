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
