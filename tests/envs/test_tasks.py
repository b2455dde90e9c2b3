import pytest

from copc_jax.envs import math_tool, search, synthetic_tasks
from copc_jax.envs.tasks import TaskConfig, make_task


def test_tool_arithmetic_scores_the_demonstration_and_runs_the_tool():
  task = make_task(TaskConfig(name="tool_arithmetic", train_size=16, eval_size=4))
  record = task.train[0]
  demo = synthetic_tasks.arithmetic_demonstration(record)
  assert task.score(demo, record) == (1.0, True)
  assert task.score("<answer>12</answer>", record) == (0.0, False)
  turn = demo.split(math_tool.CODE_CLOSE)[0] + math_tool.CODE_CLOSE
  assert record["answer"] in task.tool(turn)
  assert task.prompt(record).startswith(math_tool.SYSTEM_PROMPT)
  assert not {r["question"] for r in task.train} & {r["question"] for r in task.eval}


def test_demo_tool_fraction_mixes_direct_answers():
  task = make_task(TaskConfig(name="tool_arithmetic", train_size=200, demo_tool_fraction=0.5,
                              system_prompt=False))
  demos = task.demonstrations(task.train)
  with_tool = sum(math_tool.CODE_OPEN in d["response"] for d in demos)
  assert 70 < with_tool < 130
  assert demos[0]["prompt"] == task.train[0]["question"] + "\n"
  direct = [(d, r) for d, r in zip(demos, task.train) if math_tool.CODE_OPEN not in d["response"]]
  assert all(task.score(d["response"], r)[0] == 0.0 for d, r in direct[:10])   # estimates are not exact


def test_code_errors_are_penalised():
  task = make_task(TaskConfig(name="tool_arithmetic", train_size=4, code_error_penalty=0.1))
  record = task.train[0]
  failed = task.tool(f"{math_tool.CODE_OPEN}1/0{math_tool.CODE_CLOSE}")
  assert math_tool.count_code_errors(failed) == 1
  reward, correct = task.score(failed + f"<answer>{record['answer']}</answer>", record)
  assert correct and reward == pytest.approx(0.9)


def test_knowledge_search_tool_finds_the_passage():
  task = make_task(TaskConfig(name="knowledge_search", train_size=8, eval_size=4))
  record = next(r for r in task.train if r["hops"] == 1)
  info = task.tool(f"{search.SEARCH_OPEN}{record['entity']} born{search.SEARCH_CLOSE}")
  assert f"{record['entity']} was born in {record['answer']}" in info
  assert task.score(f"<answer>{record['answer']}</answer>", record) == (1.0, True)


def test_real_data_tasks_name_the_missing_field_or_file(tmp_path):
  with pytest.raises(ValueError, match="config.task.train_path is required"):
    make_task(TaskConfig(name="math"))
  with pytest.raises(FileNotFoundError, match=r"config.task.train_path: .*missing.jsonl does not exist"):
    make_task(TaskConfig(name="math", train_path=str(tmp_path / "missing.jsonl"), eval_path="x"))
  with pytest.raises(ValueError, match="name must be one of"):
    TaskConfig(name="chess")


def test_math_and_search_tasks_from_files():
  math = make_task(TaskConfig(name="math", train_path="tests/fixtures/gsm8k_sample.jsonl",
                              eval_path="tests/fixtures/gsm8k_sample.jsonl"))
  assert math.train and math.demonstration is None
  with pytest.raises(ValueError, match="no demonstrations"):
    math.demonstrations(math.train)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_template_wraps_the_prompt_as_one_user_turn(tmp_path):
  """`task.chat_template`: the prompt the policy sees is the tokenizer's template around the task's
  own prompt, with the generation prompt; saved and loaded with the tokenizer; the demonstrations
  of the warm start use the same prompt."""
  import transformers

  from copc_jax.models import hf_io, tiny

  tokenizer = tiny.make_tokenizer()
  tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)    # as Qwen's tokenizer has them
  tokenizer.chat_template = CHATML
  tokenizer.save_pretrained(tmp_path)
  loaded = hf_io.load_tokenizer(str(tmp_path), needed_for="this test")
  assert isinstance(loaded, transformers.PreTrainedTokenizerBase)
  plain = make_task(TaskConfig(name="tool_arithmetic", train_size=8, eval_size=4))
  chat = make_task(TaskConfig(name="tool_arithmetic", train_size=8, eval_size=4, chat_template=True),
                   tokenizer=loaded)
  record = chat.train[0]
  assert chat.prompt(record) == f"<|im_start|>user\n{plain.prompt(record)}<|im_end|>\n<|im_start|>assistant\n"
  assert chat.demonstrations([record])[0]["prompt"] == chat.prompt(record)
  ids = loaded.encode(chat.prompt(record), add_special_tokens=False)
  assert loaded.convert_tokens_to_ids("<|im_start|>") in ids                # the tags are whole tokens


def test_a_chat_template_without_one_in_the_tokenizer_is_one_clear_error():
  from copc_jax.models import tiny

  with pytest.raises(ValueError, match="chat_template=True needs a tokenizer with a chat template"):
    make_task(TaskConfig(name="tool_arithmetic", train_size=8, eval_size=4, chat_template=True),
              tokenizer=tiny.make_tokenizer())


def test_a_task_of_ones_own_is_registered_by_its_module():
  task = make_task(TaskConfig(name="echo", module="tests.fixtures.echo_task"), seed=3)
  assert task.name == "echo" and task.train[0]["question"] == "Repeat w30:"
  assert task.score("w30", task.train[0]) == (1.0, True)
  assert task.demonstrations(task.train[:1])[0] == {"prompt": "Repeat w30:", "response": "w30"}
  with pytest.raises(ValueError, match=r"name must be one of .* \(or give task.module"):
    TaskConfig(name="echo")
  with pytest.raises(ValueError, match="config.task.module='no.such.module' cannot be imported"):
    make_task(TaskConfig(name="echo", module="no.such.module"))
  with pytest.raises(ValueError, match="has no make_task"):
    make_task(TaskConfig(name="echo", module="copc_jax.envs.data"))
