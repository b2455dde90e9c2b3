
import pytest
from scripted_pool import ScriptedPool

from copc_jax.envs import data
from copc_jax.envs.tasks import TaskConfig, make_task
from copc_jax.models import tiny
from copc_jax.rollout.config import RolloutConfig
from copc_jax.rollout.protocol import Generation, WeightUpdate
from copc_jax.train.episodes import AsyncCollector, Episode, EpisodeRunner, PromptSource
from copc_jax.train.staleness import AdmissionControl, TrajectoryBuffer


@pytest.fixture(scope="module")
def tokenizer():
  return tiny.make_tokenizer()


@pytest.fixture(scope="module")
def task():
  return make_task(TaskConfig(name="tool_arithmetic", train_size=64, eval_size=8, system_prompt=False))


def test_an_episode_that_follows_the_demonstration_earns_the_reward(tokenizer, task):
  record = task.train[3]
  a, b = record["operands"]
  turns = [f"<code>print({a} * {b})</code>", f"<answer>{a * b}</answer>"]
  calls = []

  def generate(context, max_tokens, **sampling):
    calls.append((list(context), max_tokens, sampling))
    ids = tokenizer.encode(turns[len(calls) - 1], add_special_tokens=False)
    if len(calls) == 2:
      ids.append(tokenizer.eos_token_id)
    reason = "stop_sequence" if len(calls) == 1 else "stop"
    return Generation(ids, [-0.1] * len(ids), [7] * len(ids), reason)

  runner = EpisodeRunner(generate, task, tokenizer, RolloutConfig(max_length=128))
  episode = runner.run(record, greedy=True)
  assert episode.correct and episode.trajectory.reward == 1.0
  assert episode.oldest_version == 7
  text = tokenizer.decode(episode.trajectory.token_ids)
  assert f"<output>\n{a * b}\n</output>" in text
  tool_ids = [t for t, m in zip(episode.trajectory.token_ids, episode.trajectory.mask) if not m]
  assert tokenizer.decode(tool_ids).strip().startswith("<output>")
  assert calls[0][0] == [tokenizer.bos_token_id] + tokenizer.encode(f"{record['question']}\n")
  assert calls[0][2]["top_k"] == 1                                # greedy evaluation
  assert calls[1][1] <= 128 - len(calls[1][0])                    # never asks past max_length


def test_episode_json_round_trip(tokenizer, task):
  pool = ScriptedPool(len(tokenizer), tool_call_end=tokenizer.encode("</code>", add_special_tokens=False))
  runner = EpisodeRunner(pool.generate, task, tokenizer, RolloutConfig())
  pool.push(WeightUpdate(0, "unused"))
  episode = runner.run(task.train[0])
  again = Episode.from_json(episode.to_json())
  assert again.trajectory == episode.trajectory and again.correct == episode.correct


def test_prompt_source_requeues_in_flight_prompts_first(task):
  source = PromptSource(data.PromptIterator(task.train, seed=1))
  first = source.take(3)
  state = source.state(in_flight=[first[2]])
  later = source.take(2)
  resumed = PromptSource(data.PromptIterator(task.train, seed=1, state=state["iterator"]),
                                  state["requeued"], state["draws"])
  assert resumed.take(3) == [first[2]] + later
  assert [r["draw"] for r in first + later] == [0, 1, 2, 3, 4]   # the sampling key of each episode


@pytest.mark.parametrize("max_staleness,sync_every", [(0, 1), (2, 1), (3, 2)])
def test_async_collection_never_hands_out_stale_episodes(tokenizer, task, max_staleness, sync_every):
  pool = ScriptedPool(len(tokenizer), delay_s=0.01, seed=max_staleness)
  runner = EpisodeRunner(pool.generate, task, tokenizer,
                                  RolloutConfig(max_tokens_per_turn=4, max_turns=1))
  batch = 4
  admission = AdmissionControl(max_staleness, batch)
  buffer = TrajectoryBuffer(max_staleness)
  pool.push(WeightUpdate(0, "unused"))
  collector = AsyncCollector(runner, PromptSource(data.PromptIterator(task.train)),
                                      admission, buffer, workers=6, weights_version=lambda: pool.version)
  collector.start()
  seen = []
  try:
    for version in range(12):
      units, staleness = collector.take(batch, version)           # groups of one episode each
      episodes = [episode for unit in units for episode in unit]
      token_staleness = [version - v for e in episodes for v, m in zip(e.trajectory.versions,
                                                                       e.trajectory.mask) if m]
      seen += token_staleness
      assert max(staleness) <= max_staleness and max(token_staleness) <= max_staleness
      admission.on_update(batch)
      if (version + 1) % sync_every == 0:
        pool.push(WeightUpdate(version + 1, "unused"))
        admission.wake()
  finally:
    collector.stop()
  state = collector.state()
  assert len(state["buffer"]) == len(buffer)
  if max_staleness:
    assert max(seen) > 0          # the collector did run ahead of the learner


def test_async_collector_hands_over_worker_errors(tokenizer, task):
  def broken(*args, **kwargs):
    raise ConnectionError("all servers are gone")

  runner = EpisodeRunner(broken, task, tokenizer, RolloutConfig())
  collector = AsyncCollector(runner, PromptSource(data.PromptIterator(task.train)),
                                      AdmissionControl(1, 2), TrajectoryBuffer(1), workers=2,
                                      weights_version=lambda: 0)
  collector.start()
  with pytest.raises(ConnectionError, match="all servers are gone"):
    collector.take(2, 0)
  collector.stop()
  assert len(collector.state()["data"]["requeued"]) >= 1      # the failed prompts will run again


def test_prompts_that_do_not_fit_are_recognised(tokenizer, task):
  runner = EpisodeRunner(lambda *a, **k: None, task, tokenizer,
                                  RolloutConfig(max_prefill_length=16, max_length=64))
  assert not runner.fits({"question": "x" * 40})
  assert runner.fits({"question": "What is 2 * 3?"})
