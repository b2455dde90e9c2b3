"""Prompt datasets: JSONL/parquet records through `grain`, shuffled, sharded and resumable.

    records = read_records("train.parquet", question_field="problem", answer_field="solution")
    it = PromptIterator(records, seed=0, shard_index=jax.process_index(), shard_count=jax.process_count())
    batch = [next(it) for _ in range(8)]
    state = it.get_state()        # JSON-serialisable; PromptIterator(..., state=state) resumes
"""

from __future__ import annotations

import json
import os

import grain

FORMATS = ("jsonl", "parquet")


def _format_of(path: str) -> str:
  for fmt, suffixes in (("jsonl", (".jsonl", ".json")), ("parquet", (".parquet",))):
    if path.endswith(suffixes):
      return fmt
  raise ValueError(f"{path}: unknown data format; allowed suffixes: .jsonl, .json, .parquet")


def read_records(path: str, *, question_field: str = "question", answer_field: str = "answer",
                 keep_fields: tuple[str, ...] = ()) -> list[dict]:
  """Rows as {"index", "question", "answer", *keep_fields}; names the missing field if any.

  `answer` is a string, or a list of strings where the source lists several
  acceptable answers (NQ / Search-R1's `golden_answers`).
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"data file not found: {path}")
  if _format_of(path) == "jsonl":
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  else:
    import pyarrow.parquet as pq
    rows = pq.read_table(path).to_pylist()
  records = []
  for i, row in enumerate(rows):
    for field in (question_field, answer_field, *keep_fields):
      if field not in row:
        raise ValueError(f"{path} row {i}: no field {field!r}; the row has {sorted(row)}")
    answer = row[answer_field]
    answer = [str(a) for a in answer] if isinstance(answer, list | tuple) else str(answer)
    records.append({"index": i, "question": row[question_field], "answer": answer,
                    **{k: row[k] for k in keep_fields}})
  if not records:
    raise ValueError(f"{path}: no records")
  return records


def prompt_dataset(records: list[dict], *, seed: int = 0, shuffle: bool = True, shard_index: int = 0,
                   shard_count: int = 1) -> grain.MapDataset:
  """One learner process's shard of the records, reshuffled each epoch, repeated forever."""
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index must be in [0, {shard_count}); got {shard_index}")
  dataset = grain.MapDataset.source(records)[shard_index::shard_count]
  if len(dataset) == 0:
    raise ValueError(f"shard {shard_index}/{shard_count} of {len(records)} records is empty")
  if shuffle:
    dataset = dataset.shuffle(seed=seed)
  return dataset.repeat(None)


class PromptIterator:
  """An endless iterator over `prompt_dataset` whose position can be saved and restored."""

  def __init__(self, records: list[dict], *, seed: int = 0, shuffle: bool = True, shard_index: int = 0,
               shard_count: int = 1, state: dict | None = None):
    dataset = prompt_dataset(records, seed=seed, shuffle=shuffle, shard_index=shard_index,
                             shard_count=shard_count)
    self._iterator = iter(dataset.to_iter_dataset())
    if state is not None:
      self._iterator.set_state(state)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    return next(self._iterator)

  def get_state(self) -> dict:
    return self._iterator.get_state()
