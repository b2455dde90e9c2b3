import numpy as np
import pytest

from copc_jax import sampling
from copc_jax.models import hf_io, tiny
from copc_jax.rollout import agent
from copc_jax.rollout.client import Generation
from copc_jax.rollout.process import ServerProcess
from copc_jax.train.batch import TrajectoryBatch

TOOL_OUTPUT = [60, 61, 62]


def fixed_tool(turn_tokens):
  return list(TOOL_OUTPUT)


def test_episode_structure_with_a_scripted_generator():
  script = [Generation([5, 6, 9], [-1.0, -2.0, -3.0], [4, 4, 4], "stop_sequence"),
            Generation([7, 2], [-0.5, -0.1], [5, 5], "stop")]
  seen_contexts = []

  def generate(context, max_tokens, **kw):
    seen_contexts.append(list(context))
    return script[len(seen_contexts) - 1]

  t = agent.run_episode(generate, [1, 3], tool=fixed_tool, tool_call_end=[9], max_turns=4)
  assert t.token_ids == [5, 6, 9, 60, 61, 62, 7, 2]
  assert t.mask == [True] * 3 + [False] * 3 + [True] * 2
  assert t.versions == [4, 4, 4, -1, -1, -1, 5, 5]
  assert t.finish_reason == "stop" and t.num_turns == 2
  assert seen_contexts[1] == [1, 3, 5, 6, 9, 60, 61, 62]      # continues from ids, no re-tokenising
  t.reward = 1.0
  batch = TrajectoryBatch.from_episodes([t, agent.Trajectory(prompt_ids=[1])], length=12)
  batch.validate()
  assert batch.rewards[0].nonzero()[0].tolist() == [9] and batch.mask[0, 5:8].tolist() == [False] * 3
  assert batch.behavior_logprobs[0, 2:5].tolist() == [-1.0, -2.0, -3.0]


def test_an_episode_continues_from_inside_a_turn():
  full = agent.Trajectory(prompt_ids=[1, 3])
  full.append([5, 6, 9], generated=True, logprobs=[-1.0] * 3, versions=[0] * 3)
  full.append(TOOL_OUTPUT, generated=False)
  full.append([7, 8], generated=True, logprobs=[-1.0] * 2, versions=[0] * 2)
  full.num_turns = 2
  seen_turns, contexts = [], []

  def tool(turn_tokens):
    seen_turns.append(list(turn_tokens))
    return list(TOOL_OUTPUT)

  def generate(context, max_tokens, **kw):
    contexts.append((list(context), max_tokens))
    return Generation([6, 9], [-0.5, -0.5], [1, 1], "stop_sequence") if len(contexts) == 1 else \
        Generation([2], [-0.1], [1], "stop")

  inside = agent.prefix(full, 1)                                 # [5]: the first turn in progress
  assert inside.num_turns == 1 and inside.mask == [True]
  t = agent.continue_episode(generate, inside, tool=tool, tool_call_end=[9], max_turns=4,
                             max_tokens_per_turn=8)
  assert seen_turns == [[5, 6, 9]]                               # the tool sees the whole turn
  assert contexts[0] == ([1, 3, 5], 7)                           # the turn's budget counts its start
  assert t.token_ids == [5, 6, 9, *TOOL_OUTPUT, 2] and t.num_turns == 2 and t.finish_reason == "stop"
  seen_turns.clear()
  at_call = agent.continue_episode(lambda *a, **k: Generation([2], [-0.1], [1], "stop"), agent.prefix(full, 3),
                                   tool=tool, tool_call_end=[9], max_turns=4)
  assert seen_turns == [[5, 6, 9]] and at_call.token_ids == [5, 6, 9, *TOOL_OUTPUT, 2]
  ended = agent.continue_episode(None, agent.prefix(full, 8), tool=tool, tool_call_end=[9], stop_ids=[8])
  assert ended.finish_reason == "stop" and ended.token_ids == full.token_ids
  assert agent.prefix(full, 7).num_turns == 2


def test_turn_limit():
  generate = lambda context, max_tokens, **kw: Generation([9], [-1.0], [0], "stop_sequence")
  t = agent.run_episode(generate, [1], tool=fixed_tool, tool_call_end=[9], max_turns=3)
  assert t.finish_reason == "max_turns" and t.num_turns == 3 and len(t.token_ids) == 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("agent") / "tiny")
  tiny.make_tiny_checkpoint(path, "qwen2", seed=0)
  process = ServerProcess(path, slots=2, max_prefill_length=64, max_length=160)
  process.wait_ready()
  client = process.client()
  yield path, client
  client.close()
  process.stop()


def test_episode_against_a_real_server_logprobs_match_the_learner(served):
  path, client = served
  prompt = [1, 20, 21, 22]
  first = client.generate(prompt, max_tokens=4, temperature=0.01).token_ids[0]   # near-greedy
  t = agent.run_episode(client.generate, prompt, tool=fixed_tool, tool_call_end=[first], max_turns=2,
                        max_tokens_per_turn=6, temperature=0.01)
  assert t.num_turns >= 1 and False in t.mask                                      # the tool ran
  model, _ = hf_io.from_pretrained(path, load_tokenizer=False)
  context = np.array([t.context])
  recomputed = np.asarray(sampling.sampling_logprobs(model(context), context, temperature=0.01))[0]
  generated = np.array([False] * len(prompt) + t.mask)
  np.testing.assert_allclose(np.array(t.logprobs)[np.array(t.mask)], recomputed[generated], atol=1e-4)


def test_plain_single_turn_generation_without_a_tool_marker(served):
  """A task with no tool call marker: one turn, no stop sequence sent (the server refuses an empty
  one), the tool never runs; and the server's Status reports compile times and memory."""
  _, client = served
  ran_tool = []
  t = agent.run_episode(client.generate, [1, 30, 31], tool=lambda turn: ran_tool.append(turn) or [],
                        tool_call_end=[], max_turns=3, max_tokens_per_turn=8, seed=4)
  assert t.num_turns == 1 and all(t.mask) and not ran_tool and t.finish_reason in ("stop", "length")
  status = client.status()
  assert all(status["compile_s"][name] > 0 for name in ("prefill", "insert", "generate"))
  assert 0 < status["memory"]["resident_bytes"] <= status["memory"]["peak_resident_bytes"]
  assert (status["queue_length"], status["live"]) == (0, True)
