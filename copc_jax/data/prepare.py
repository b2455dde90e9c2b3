"""Turn a public dataset's file into the task's rows: JSONL of {"question", "answer"}.

    python -m copc_jax.data.prepare --source=dapo_math --input=dapo-math-17k.parquet --output=train.jsonl
    python -m copc_jax.data.prepare --source=aime_2024 --input=aime_2024.parquet --output=eval.jsonl
    python -m copc_jax.data.prepare --source=search_r1 --input=nq_hotpotqa_train.parquet --output=train.jsonl

Each source has its own field map, from the original release's schema:

| source      | release                     | question                          | answer                     |
| ----------- | --------------------------- | --------------------------------- | -------------------------- |
| `dapo_math` | DAPO-Math-17k (verl format) | `prompt[0].content`, wrapper cut  | `reward_model.ground_truth`|
| `aime_2024` | AIME 2024                   | `Problem`                         | `Answer`                   |
| `search_r1` | Search-R1 NQ + HotpotQA     | `question`                        | `golden_answers` (a list)  |

The rows keep the source's id where it has one (`id`), and the task configs read them with
`question_field="question"`, `answer_field="answer"`. A row without a field of the map is one line
naming the row and the field.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

from absl import app, flags

# DAPO-Math-17k wraps every problem in this instruction (the verl-format `prompt` message); the task
# gives its own instructions (`math_tool.format_prompt`), so the wrapper is cut.
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def _field(row: dict, path: str, where: str):
  """`row`'s value at a dotted path; list items by index (`prompt.0.content`)."""
  value = row
  for part in path.split("."):
    try:
      value = value[int(part)] if isinstance(value, list) else value[part]
    except (KeyError, IndexError, ValueError, TypeError):
      raise ValueError(f"{where}: no field {path!r} (the row has {sorted(row)})") from None
  return value


def _dapo_math(row: dict, where: str) -> dict:
  question = _field(row, "prompt.0.content", where)
  question = question.removeprefix(DAPO_PREFIX).removesuffix(DAPO_SUFFIX).strip()
  return {"question": question, "answer": str(_field(row, "reward_model.ground_truth", where))}


def _aime_2024(row: dict, where: str) -> dict:
  return {"question": _field(row, "Problem", where).strip(), "answer": str(_field(row, "Answer", where))}


def _search_r1(row: dict, where: str) -> dict:
  answers = _field(row, "golden_answers", where)
  answers = [str(a) for a in answers] if isinstance(answers, list | tuple) else [str(answers)]
  return {"question": _field(row, "question", where).strip(), "answer": answers}


SOURCES: dict[str, Callable[[dict, str], dict]] = {"dapo_math": _dapo_math, "aime_2024": _aime_2024,
                                                   "search_r1": _search_r1}
ID_FIELDS = ("id", "ID", "extra_info.index")


def read_rows(path: str) -> list[dict]:
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq
    return pq.read_table(path).to_pylist()
  if path.endswith((".jsonl", ".json")):
    with open(path) as f:
      return [json.loads(line) for line in f if line.strip()]
  raise ValueError(f"{path}: unknown format; allowed suffixes: .parquet, .jsonl, .json")


def prepare(source: str, rows: list[dict], name: str = "input") -> list[dict]:
  """The task's rows of `rows` read by `source`'s field map."""
  if source not in SOURCES:
    raise ValueError(f"source must be one of {sorted(SOURCES)}; got {source!r}")
  out = []
  for i, row in enumerate(rows):
    record = SOURCES[source](row, f"{name} row {i}")
    for path in ID_FIELDS:
      try:
        record["id"] = str(_field(row, path, ""))
        break
      except ValueError:
        continue
    out.append(record)
  if not out:
    raise ValueError(f"{name}: no rows")
  return out


def write_jsonl(records: list[dict], path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


FLAGS = flags.FLAGS
flags.DEFINE_enum("source", None, sorted(SOURCES), "Which release the input is (its field map).")
flags.DEFINE_string("input", None, "The release's file (.parquet or .jsonl).")
flags.DEFINE_string("output", None, "Where the task's rows go (JSONL).")


def main(argv):
  del argv
  try:
    if not FLAGS.source or not FLAGS.input or not FLAGS.output:
      raise ValueError("--source, --input and --output are required")
    if not os.path.exists(FLAGS.input):
      raise ValueError(f"--input: {FLAGS.input} does not exist")
    records = prepare(FLAGS.source, read_rows(FLAGS.input), FLAGS.input)
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
  write_jsonl(records, FLAGS.output)
  print(f"{len(records)} rows of {FLAGS.source} -> {FLAGS.output}")


if __name__ == "__main__":
  app.run(main)
