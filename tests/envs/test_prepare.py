"""`python -m copc_jax.data.prepare`: each release's fixture (its exact schema, made-up rows) becomes
the task's rows, which the math and search tasks read as they are."""

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from copc_jax.data import prepare
from copc_jax.envs import data
from copc_jax.envs.tasks import TaskConfig, make_task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "releases")


def _run(*args):
  return subprocess.run([sys.executable, "-m", "copc_jax.data.prepare", *args], capture_output=True, text=True,
                        timeout=120, cwd=ROOT)


def test_each_release_becomes_the_tasks_rows(tmp_path):
  dapo = prepare.prepare("dapo_math", prepare.read_rows(os.path.join(FIXTURES, "dapo_math_17k.parquet")))
  assert dapo[0] == {"question": "What is 12 times 13?", "answer": "156", "id": "fixture-0"}   # wrapper cut
  aime = prepare.prepare("aime_2024", prepare.read_rows(os.path.join(FIXTURES, "aime_2024.parquet")))
  assert aime[1] == {"question": "Compute 5 * 6.", "answer": "30", "id": "2024-I-2"}          # int → text
  nq = prepare.prepare("search_r1", prepare.read_rows(os.path.join(FIXTURES, "search_r1_nq_hotpotqa.parquet")))
  assert nq[0] == {"question": "who wrote the fixture novel", "answer": ["Ada Writer", "A. Writer"],
                   "id": "train_0"}
  for source, name in (("dapo_math", "dapo_math_17k"), ("aime_2024", "aime_2024")):
    out = _run(f"--source={source}", f"--input={os.path.join(FIXTURES, name + '.parquet')}",
               f"--output={tmp_path / (name + '.jsonl')}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"2 rows of {source} -> {tmp_path / (name + '.jsonl')}"
  task = make_task(TaskConfig(name="math", train_path=str(tmp_path / "dapo_math_17k.jsonl"),
                              eval_path=str(tmp_path / "aime_2024.jsonl")))
  assert [r["answer"] for r in task.eval] == ["7", "30"]
  assert task.score("<answer>156</answer>", task.train[0]) == (1.0, True)
  assert "What is 12 times 13?" in task.prompt(task.train[0])
  records = data.read_records(str(tmp_path / "aime_2024.jsonl"))
  assert records[0]["question"] == "Compute 3 + 4."


def test_a_row_without_the_maps_field_is_one_line(tmp_path):
  bad = tmp_path / "bad.parquet"
  pq.write_table(pa.Table.from_pylist([{"Problem": "1 + 1?", "Solution": "2"}]), bad)
  out = _run("--source=aime_2024", f"--input={bad}", f"--output={tmp_path / 'out.jsonl'}")
  assert out.returncode == 2 and not (tmp_path / "out.jsonl").exists()
  assert out.stderr.strip() == (f"error: {bad} row 0: no field 'Answer' (the row has ['Problem', 'Solution'])")
  missing = tmp_path / "missing.parquet"
  out = _run("--source=aime_2024", f"--input={missing}", f"--output={tmp_path / 'o.jsonl'}")
  assert out.returncode == 2 and "does not exist" in out.stderr.strip().splitlines()[-1]
