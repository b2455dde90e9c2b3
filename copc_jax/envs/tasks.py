"""Tasks for the trainer: prompts, the tool, the reward, and demonstrations for the warm start.

    task = make_task(TaskConfig(name="tool_arithmetic"), seed=0)
    prompt = task.prompt(task.train[0])
    output = task.tool(turn_text)                 # text of the turn that ended with task.tool_call_end
    reward, correct = task.score(response_text, task.train[0])

| name             | data                                   | tool                   | reward            |
| ---------------- | -------------------------------------- | ---------------------- | ----------------- |
| tool_arithmetic  | synthetic products (`synthetic_tasks`) | Python in the sandbox  | math-verify match |
| knowledge_search | synthetic knowledge base               | BM25 over its passages | exact match       |
| math             | JSONL/parquet (`train_path`, ...)      | Python in the sandbox  | math-verify match |
| search           | JSONL/parquet + corpus JSONL           | BM25 (or `retriever_url`) | EM or F1       |
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable

from copc_jax.envs import data, math_tool, search, synthetic_tasks

TASKS = ("tool_arithmetic", "knowledge_search", "math", "search")
MATH_TOOL_OUTPUT = (math_tool.OUTPUT_OPEN, math_tool.OUTPUT_CLOSE)
SEARCH_TOOL_OUTPUT = (search.INFO_OPEN, search.INFO_CLOSE)
DEMOS_PER_QUESTION = 4          # knowledge_search with 0 < demo_chain_fraction < 1


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  name: str = "tool_arithmetic"
  system_prompt: bool = True          # False: the bare question (tiny models learn the format from demos)
  chat_template: bool = False         # the prompt as a user turn through the tokenizer's chat template
                                      # (instruct checkpoints), generation prompt added
  train_size: int = 512               # synthetic tasks
  eval_size: int = 128
  demo_tool_fraction: float = 1.0     # share of demonstrations that use the tool (the rest answer directly)
  demo_max_hops: int = 2              # knowledge_search: demonstrations only up to this many hops
  demo_chain_fraction: float = 1.0    # knowledge_search: share of each 2-hop question's demonstrations that
                                      # chain the second search (the rest stop after the first, guess a city)
  train_path: str = ""                # math / search
  eval_path: str = ""
  question_field: str = "question"
  answer_field: str = "answer"
  corpus_path: str = ""               # search: JSONL passages with a "contents" field
  retriever_url: str = ""             # search: a running `copc_jax.envs.search` service instead
  topk: int = 3
  reward_metric: str = "em"           # search: "em" or "f1"
  code_timeout_s: float = 5.0
  code_error_penalty: float = 0.0
  module: str = ""                    # a task of your own: an importable module whose
                                      # `make_task(config, seed) -> Task` builds it (then any name)

  def __post_init__(self):
    if self.name not in TASKS and not self.module:
      raise ValueError(f"name must be one of {TASKS} (or give task.module, a module with make_task(config, "
                       f"seed) for a task of your own); got {self.name!r}")
    if not 0 <= self.demo_tool_fraction <= 1:
      raise ValueError(f"demo_tool_fraction must be in [0, 1]; got {self.demo_tool_fraction}")
    if not 0 <= self.demo_chain_fraction <= 1:
      raise ValueError(f"demo_chain_fraction must be in [0, 1]; got {self.demo_chain_fraction}")
    if self.train_size < 1 or self.eval_size < 1:
      raise ValueError(f"train_size and eval_size must be >= 1; got {self.train_size}, {self.eval_size}")
    if self.reward_metric not in ("em", "f1"):
      raise ValueError(f"reward_metric must be 'em' or 'f1'; got {self.reward_metric!r}")
    if self.topk < 1:
      raise ValueError(f"topk must be >= 1; got {self.topk}")
    if self.demo_max_hops not in (1, 2):
      raise ValueError(f"demo_max_hops must be 1 or 2; got {self.demo_max_hops}")


@dataclasses.dataclass
class Task:
  name: str
  train: list[dict]
  eval: list[dict]
  tool_call_end: str                                     # a turn ending with this calls the tool
  tool_output: tuple[str, str]                           # (open, close) tags around the tool's reply
  prompt: Callable[[dict], str]
  tool: Callable[[str], str]
  score: Callable[[str, dict], tuple[float, bool]]       # (response, record) -> (reward, correct)
  # record -> response, or several responses, or None (no demonstration); None here: no warm start
  demonstration: Callable[[dict], str | list[str] | None] | None = None

  def demonstrations(self, records: list[dict]) -> list[dict]:
    if self.demonstration is None:
      raise ValueError(f"task {self.name!r} has no demonstrations; set warm_start.steps = 0")
    demos = []
    for record in records:
      responses = self.demonstration(record)
      for response in [responses] if isinstance(responses, str) else responses or []:
        demos.append({"prompt": self.prompt(record), "response": response})
    return demos


def _require_file(field: str, path: str) -> str:
  if not path:
    raise ValueError(f"config.task.{field} is required for this task (a JSONL or parquet file)")
  if not os.path.exists(path):
    raise FileNotFoundError(f"config.task.{field}: {path} does not exist; download or prepare the data "
                            f"there, or point config.task.{field} at it")
  return path


def _prompt(format_prompt: Callable[[str], str], config: TaskConfig) -> Callable[[dict], str]:
  """record → prompt: the task's instructions and the question, or (no system prompt) the bare question."""
  if config.system_prompt:
    return lambda record: format_prompt(record["question"])
  return lambda record: f"{record['question']}\n"


def _math_score(config: TaskConfig):
  def score(response: str, record: dict) -> tuple[float, bool]:
    result = math_tool.math_reward(response, record["answer"], code_error_penalty=config.code_error_penalty,
                                   code_errors=math_tool.count_code_errors(response))
    return result.reward, result.correct
  return score


def _code_tool(config: TaskConfig):
  tool = math_tool.CodeTool(timeout_s=config.code_timeout_s)
  return lambda turn_text: tool(turn_text)


def _direct_answer(record: dict) -> str:
  """A tool-free answer: the product of the operands rounded to 2 significant digits."""
  a, b = record["operands"]
  estimate = int(float(f"{a:.2g}") * float(f"{b:.2g}"))
  return f"{math_tool.ANSWER_OPEN}{estimate}{math_tool.ANSWER_CLOSE}"


def _tool_arithmetic(config: TaskConfig, seed: int) -> Task:
  train, eval_ = synthetic_tasks.arithmetic_splits(seed, config.train_size, config.eval_size)
  chooser = random.Random(seed + 7)
  uses_tool = {r["question"]: chooser.random() < config.demo_tool_fraction for r in train}

  def demonstration(record):
    if uses_tool.get(record["question"], True):
      return synthetic_tasks.arithmetic_demonstration(record)
    return _direct_answer(record)

  return Task("tool_arithmetic", train, eval_, math_tool.CODE_CLOSE, MATH_TOOL_OUTPUT,
              _prompt(math_tool.format_prompt, config),
              _code_tool(config), _math_score(config), demonstration)


def _search_score(config: TaskConfig):
  def score(response: str, record: dict) -> tuple[float, bool]:
    exact = search.search_reward(response, record["answer"], metric="em")
    if config.reward_metric == "em":
      return exact, exact == 1.0
    reward = search.search_reward(response, record["answer"], metric="f1")
    return reward, exact == 1.0
  return score


def _knowledge_search(config: TaskConfig, seed: int) -> Task:
  kb, train, eval_ = synthetic_tasks.knowledge_splits(seed)
  retriever = search.Retriever(kb.passages())
  tool = search.SearchTool(retriever=retriever, topk=config.topk)
  chooser = random.Random(seed + 11)
  chained = round(DEMOS_PER_QUESTION * config.demo_chain_fraction)

  def demonstration(record):
    if record["hops"] > config.demo_max_hops:
      return None                   # left for RL to learn (e.g. two chained searches)
    if config.demo_chain_fraction == 1.0:
      return synthetic_tasks.search_demonstration(record, kb, retriever, config.topk)
    # Every question gets the same number of demonstrations; a 2-hop question's mix the chained answer
    # with guesses, so the warm-started policy chains with about this probability on every question.
    guesses = [None] * chained + [chooser.choice(kb.cities) for _ in range(DEMOS_PER_QUESTION - chained)]
    return [synthetic_tasks.search_demonstration(record, kb, retriever, config.topk, guess=guess)
            for guess in guesses]

  return Task("knowledge_search", train[:config.train_size], eval_[:config.eval_size], search.SEARCH_CLOSE,
              SEARCH_TOOL_OUTPUT, _prompt(search.format_prompt, config), tool, _search_score(config),
              demonstration)


def _records(config: TaskConfig) -> tuple[list[dict], list[dict]]:
  fields = dict(question_field=config.question_field, answer_field=config.answer_field)
  train = data.read_records(_require_file("train_path", config.train_path), **fields)
  eval_ = data.read_records(_require_file("eval_path", config.eval_path), **fields)
  return train, eval_[:config.eval_size]


def _math(config: TaskConfig, seed: int) -> Task:
  del seed
  train, eval_ = _records(config)
  return Task("math", train, eval_, math_tool.CODE_CLOSE, MATH_TOOL_OUTPUT,
              _prompt(math_tool.format_prompt, config),
              _code_tool(config), _math_score(config))


def _search(config: TaskConfig, seed: int) -> Task:
  del seed
  train, eval_ = _records(config)
  if config.retriever_url:
    tool = search.SearchTool(url=config.retriever_url, topk=config.topk)
  else:
    tool = search.SearchTool(retriever=search.Retriever.from_jsonl(
        _require_file("corpus_path", config.corpus_path)), topk=config.topk)
  return Task("search", train, eval_, search.SEARCH_CLOSE, SEARCH_TOOL_OUTPUT,
              _prompt(search.format_prompt, config), tool,
              _search_score(config))


def make_task(config: TaskConfig, seed: int = 0, tokenizer=None) -> Task:
  """The task; with `config.chat_template` its prompts go through `tokenizer`'s chat template."""
  builders = {"tool_arithmetic": _tool_arithmetic, "knowledge_search": _knowledge_search,
              "math": _math, "search": _search}
  task = _module_task(config, seed) if config.module else builders[config.name](config, seed)
  if config.chat_template:
    task.prompt = chat_prompt(task.prompt, tokenizer)
  return task


def _module_task(config: TaskConfig, seed: int) -> Task:
  """`config.module`'s `make_task(config, seed)`: a task registered by its import path."""
  import importlib
  try:
    module = importlib.import_module(config.module)
  except ImportError as err:
    raise ValueError(f"config.task.module={config.module!r} cannot be imported: {err}") from None
  if not callable(getattr(module, "make_task", None)):
    raise ValueError(f"config.task.module={config.module!r} has no make_task(config, seed)")
  task = module.make_task(config, seed)
  if not isinstance(task, Task):
    raise ValueError(f"config.task.module={config.module!r}: make_task returned {type(task).__name__}, not a "
                     f"copc_jax.envs.tasks.Task")
  return task


def chat_prompt(prompt: Callable[[dict], str], tokenizer) -> Callable[[dict], str]:
  """record → the task's prompt as one user turn of `tokenizer`'s chat template, followed by the
  template's generation prompt (the assistant turn the policy writes)."""
  if tokenizer is None or not getattr(tokenizer, "chat_template", None):
    name = getattr(tokenizer, "name_or_path", None) or "the tokenizer"
    raise ValueError(f"config.task.chat_template=True needs a tokenizer with a chat template; {name} has "
                     f"none (instruct checkpoints ship one in tokenizer_config.json)")
  return lambda record: tokenizer.apply_chat_template([{"role": "user", "content": prompt(record)}],
                                                      add_generation_prompt=True, tokenize=False)
