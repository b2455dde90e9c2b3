import os

import pytest

from copc_jax.envs import data

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")


def test_jsonl_and_parquet_with_configurable_fields():
  gsm = data.read_records(os.path.join(FIXTURES, "gsm8k_sample.jsonl"))
  assert len(gsm) == 4 and gsm[0]["answer"] == "72" and gsm[1]["index"] == 1
  math = data.read_records(os.path.join(FIXTURES, "math_sample.parquet"), question_field="problem",
                           answer_field="solution", keep_fields=("level",))
  assert math[0]["answer"] == "\\frac{5}{6}" and math[2]["level"] == "Level 2"


def test_bad_input_names_what_is_wrong(tmp_path):
  with pytest.raises(FileNotFoundError, match="data file not found"):
    data.read_records(str(tmp_path / "missing.jsonl"))
  with pytest.raises(ValueError, match=r"no field 'problem'; the row has \['answer', 'question'\]"):
    data.read_records(os.path.join(FIXTURES, "gsm8k_sample.jsonl"), question_field="problem")
  with pytest.raises(ValueError, match="unknown data format"):
    data.read_records(os.path.join(FIXTURES, "..", "conftest.py"))


def test_shards_partition_the_data_and_each_epoch_reshuffles():
  records = [{"index": i, "question": str(i), "answer": str(i)} for i in range(10)]
  seen = []
  for shard in range(3):
    it = data.PromptIterator(records, seed=1, shard_index=shard, shard_count=3)
    size = len(range(shard, 10, 3))
    first_epoch = [next(it)["index"] for _ in range(size)]
    second_epoch = [next(it)["index"] for _ in range(size)]
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(shard, 10, 3))
    seen += first_epoch
  assert sorted(seen) == list(range(10))


def test_resuming_continues_with_the_next_unseen_prompt():
  records = [{"index": i, "question": str(i), "answer": str(i)} for i in range(7)]
  it = data.PromptIterator(records, seed=3)
  consumed = [next(it)["index"] for _ in range(5)]
  state = it.get_state()
  expected = [next(it)["index"] for _ in range(6)]
  resumed = data.PromptIterator(records, seed=3, state=state)
  assert [next(resumed)["index"] for _ in range(6)] == expected
  assert set(consumed + expected[:2]) == set(range(7))


def test_nq_style_rows_keep_every_acceptable_answer():
  from copc_jax.envs import search

  nq = data.read_records(os.path.join(FIXTURES, "nq_sample.jsonl"), answer_field="golden_answers",
                         keep_fields=("id",))
  assert nq[1]["answer"] == ["Canberra", "Canberra, ACT"] and nq[1]["id"] == "nq_1"
  assert search.search_reward("<answer>canberra, act</answer>", nq[1]["answer"]) == 1.0
