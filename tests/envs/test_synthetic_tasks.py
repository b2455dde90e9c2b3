import os
import subprocess
import sys

import pytest

from copc_jax.envs import math_tool, sandbox, search, synthetic_tasks
from copc_jax.models import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generation_is_deterministic_and_splits_are_disjoint():
  train, evaluation = synthetic_tasks.arithmetic_splits(seed=3, train=50, eval=20)
  assert synthetic_tasks.arithmetic_splits(seed=3, train=50, eval=20) == (train, evaluation)
  assert not {p["question"] for p in train} & {p["question"] for p in evaluation}
  kb, ktrain, keval = synthetic_tasks.knowledge_splits(seed=3)
  assert synthetic_tasks.knowledge_splits(seed=3)[1] == ktrain
  assert not {q["question"] for q in ktrain} & {q["question"] for q in keval}
  assert {q["hops"] for q in keval} == {1, 2}


def test_demonstrations_earn_full_reward_and_the_tokenizer_covers_them():
  tokenizer = tiny.make_tokenizer()
  train, _ = synthetic_tasks.arithmetic_splits(seed=0, train=5, eval=1)
  kb, ktrain, _ = synthetic_tasks.knowledge_splits(seed=0)
  retriever = search.Retriever(kb.passages())
  texts = []
  for p in train:
    demo = synthetic_tasks.arithmetic_demonstration(p)
    assert math_tool.math_reward(demo, p["answer"]).correct
    texts += [math_tool.format_prompt(p["question"]), demo]
  for q in ktrain[:10]:
    demo = synthetic_tasks.search_demonstration(q, kb, retriever)
    assert search.search_reward(demo, q["answer"]) == 1.0
    texts += [search.format_prompt(q["question"]), demo]
  for text in texts:
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id not in ids, text
    assert tokenizer.decode(ids) == text


@pytest.mark.skipif(sandbox.unavailable_reason() is not None and os.geteuid() != 0,
                    reason="the sandbox needs bubblewrap (setup.sh installs it as root)")
def test_oracle_script_shows_the_tool_is_needed():
  result = subprocess.run([sys.executable, "-m", "experiments.oracle_tasks"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  rows = {line.split()[0] + line.split()[1]: line.split()[-2:] for line in result.stdout.splitlines()[1:]}
  for with_tool, without in rows.values():
    assert float(with_tool) > 0.9 and float(without) < 0.2


def test_knowledge_search_can_leave_two_hop_questions_to_rl():
  from copc_jax.envs.tasks import TaskConfig, make_task

  every = make_task(TaskConfig(name="knowledge_search", topk=1), 0)
  one_hop = make_task(TaskConfig(name="knowledge_search", topk=1, demo_max_hops=1), 0)
  assert [r["question"] for r in one_hop.train] == [r["question"] for r in every.train]   # RL sees all
  demos = one_hop.demonstrations(one_hop.train)
  assert len(demos) == sum(r["hops"] == 1 for r in one_hop.train) < len(every.demonstrations(every.train))
  assert all("founder" not in d["prompt"] for d in demos)


def test_knowledge_search_chain_fraction_mixes_guesses_into_every_two_hop_question():
  from copc_jax.envs import search
  from copc_jax.envs.tasks import DEMOS_PER_QUESTION, TaskConfig, make_task

  task = make_task(TaskConfig(name="knowledge_search", topk=1, demo_chain_fraction=0.5), 0)
  two_hop = [r for r in task.train if r["hops"] == 2][:30]
  for record in two_hop:          # each question: half its demonstrations chain (and are right), half guess
    demos = task.demonstrations([record])
    assert len(demos) == DEMOS_PER_QUESTION
    chained = [d for d in demos if d["response"].count(search.SEARCH_OPEN) == 2]
    assert len(chained) == DEMOS_PER_QUESTION // 2
    assert all(task.score(d["response"], record)[0] == 1.0 for d in chained)
    assert all(d["response"].count(search.SEARCH_OPEN) == 1 for d in demos if d not in chained)
  one_hop = task.demonstrations([r for r in task.train if r["hops"] == 1][:5])
  assert len(one_hop) == 5 * DEMOS_PER_QUESTION and all(d["response"].count(search.SEARCH_OPEN) == 1
                                                        for d in one_hop)
  every = make_task(TaskConfig(name="knowledge_search", topk=1), 0)        # the default: one each, all chain
  assert len(every.demonstrations(two_hop)) == len(two_hop)
