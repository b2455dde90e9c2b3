"""Episodes for the trainer: task episodes over a rollout backend, collected in lock-step or in the background.

    runner = EpisodeRunner(pool.generate, task, tokenizer, rollout_config)
    trajectories = collect(runner, records)                      # sync and lag modes
    collector = AsyncCollector(runner, prompts, admission, buffer, workers=16,
                               weights_version=lambda: published_version)
    collector.start()                                            # async mode

`AsyncCollector` starts an episode only when the admission control allows it
(against the version the servers hold now), and keeps the prompts of episodes
in flight so a checkpoint can re-queue them: nothing taken from the data
iterator is lost by a crash.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

from copc_jax.envs.tasks import Task
from copc_jax.rollout.agent import GenerateFn, Trajectory, continue_episode, request_seed, run_episode
from copc_jax.rollout.config import RolloutConfig
from copc_jax.train.staleness import AdmissionControl, TrajectoryBuffer


@dataclasses.dataclass
class Episode:
  """A finished episode: the trajectory, its task record and whether the answer was right."""

  trajectory: Trajectory
  record: dict
  correct: bool

  @property
  def oldest_version(self) -> int:
    return min((v for v, m in zip(self.trajectory.versions, self.trajectory.mask, strict=True) if m),
               default=-1)

  def to_json(self) -> dict:
    return {"trajectory": dataclasses.asdict(self.trajectory), "record": self.record, "correct": self.correct}

  @classmethod
  def from_json(cls, payload: dict) -> Episode:
    return cls(Trajectory(**payload["trajectory"]), payload["record"], payload["correct"])


class EpisodeRunner:
  """Runs task episodes through a generate function (the pool's); thread-safe.

  Sampling is keyed by the episode: its seed derives from `seed` (the run's),
  the record's draw number in the prompt stream (`PromptSource`) and its
  question, so an episode's tokens do not depend on which server or slot ran it.
  """

  def __init__(self, generate: GenerateFn, task: Task, tokenizer, config: RolloutConfig, *, seed=0):
    self.generate, self.task, self.tokenizer, self.config = generate, task, tokenizer, config
    self.seed = seed
    self.tool_call_end = tokenizer.encode(task.tool_call_end, add_special_tokens=False)

  def prompt_ids(self, record: dict) -> list[int]:
    bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
    return bos + self.tokenizer.encode(self.task.prompt(record), add_special_tokens=False)

  def fits(self, record: dict) -> bool:
    return len(self.prompt_ids(record)) <= self.config.max_prefill_length

  def _tool(self, turn_ids: list[int]) -> list[int]:
    output = self.task.tool(self.tokenizer.decode(turn_ids, skip_special_tokens=True))
    return self.tokenizer.encode(output, add_special_tokens=False)

  def run(self, record: dict, *, greedy: bool = False) -> Episode:
    c = self.config
    sampling = dict(temperature=1.0, top_p=1.0, top_k=1) if greedy else dict(
        temperature=c.temperature, top_p=c.top_p, top_k=c.top_k)
    seed = request_seed(self.seed, record.get("draw"), record["question"], *(
        (record["sample"],) if record.get("sample") else ()))        # the j-th sample of a group
    trajectory = run_episode(self.generate, self.prompt_ids(record), tool=self._tool,
                             tool_call_end=self.tool_call_end, max_turns=c.max_turns,
                             max_tokens_per_turn=c.max_tokens_per_turn,
                             max_prompt_length=c.max_prefill_length, max_length=c.max_length, seed=seed,
                             **sampling)
    return self._scored(trajectory, record)

  def continue_from(self, trajectory: Trajectory, record: dict, *, seed: int) -> Episode:
    """Play the episode of `record` on from `trajectory` (a prefix, possibly inside a turn), scored."""
    c = self.config
    played = continue_episode(self.generate, trajectory, tool=self._tool, tool_call_end=self.tool_call_end,
                              max_turns=c.max_turns, max_tokens_per_turn=c.max_tokens_per_turn,
                              max_prompt_length=c.max_prefill_length, max_length=c.max_length, seed=seed,
                              stop_ids=[self.tokenizer.eos_token_id], temperature=c.temperature,
                              top_p=c.top_p, top_k=c.top_k)
    return self._scored(played, record)

  def _scored(self, trajectory: Trajectory, record: dict) -> Episode:
    response = self.tokenizer.decode(trajectory.token_ids, skip_special_tokens=True)
    trajectory.reward, correct = self.task.score(response, record)
    return Episode(trajectory, record, bool(correct))


def collect(runner: EpisodeRunner, records: list[dict], workers: int, *, greedy: bool = False
            ) -> list[Episode]:
  """Run one episode per record concurrently; results in record order."""
  with ThreadPoolExecutor(max(1, min(workers, len(records)))) as executor:
    return list(executor.map(lambda r: runner.run(r, greedy=greedy), records))


def group_id(record: dict, process_index: int = 0) -> int:
  """The group of a training record: its prompt draw (the `group_size` samples of a prompt share it),
  made distinct across learner processes."""
  return (record.get("draw", 0) * 4096 + process_index) % 2 ** 31


class PromptSource:
  """Records from the data iterator, after any re-queued ones; thread-safe and checkpointable.

  Each record handed out carries `draw`, its position in this process's prompt
  stream (the same prompt in a later epoch gets a new one): the key of its episode's sampling.
  With `group_size` n > 1 every prompt is handed out n times in a row, as a group (`next_group`),
  the copies numbered by `sample` (0 … n − 1), each sampled with its own seed.
  """

  def __init__(self, iterator, requeued: list[dict] | None = None, draws: int = 0, *, group_size: int = 1):
    self._iterator = iterator
    self._requeued = list(requeued or [])
    self._draws = draws
    self.group_size = group_size
    self._lock = threading.Lock()

  def _next_draw(self) -> list[dict]:
    record = dict(next(self._iterator), draw=self._draws)
    self._draws += 1
    if self.group_size == 1:
      return [record]
    return [dict(record, sample=j) for j in range(self.group_size)]

  def next(self) -> dict:
    with self._lock:
      if not self._requeued:
        self._requeued = self._next_draw()
      return self._requeued.pop(0)

  def next_group(self) -> list[dict]:
    """The `group_size` records of one prompt (re-queued ones first: they were saved as whole groups)."""
    with self._lock:
      if len(self._requeued) < self.group_size:
        self._requeued += self._next_draw()
      group, self._requeued = self._requeued[:self.group_size], self._requeued[self.group_size:]
      return group

  def take(self, n: int) -> list[dict]:
    """`n` records: whole groups (n must be a multiple of `group_size`)."""
    if n % self.group_size:
      raise ValueError(f"take({n}): not a whole number of groups of {self.group_size}")
    return [record for _ in range(n // self.group_size) for record in self.next_group()]

  def state(self, in_flight: list[dict] = ()) -> dict:
    """The iterator position and the records to run first on resume (`in_flight` ones included)."""
    with self._lock:
      return {"iterator": self._iterator.get_state(), "requeued": list(in_flight) + self._requeued,
              "draws": self._draws}


def units_to_json(items) -> list:
  """Buffered (unit, oldest version) pairs → JSON: each unit a list of episodes."""
  return [([e.to_json() for e in unit], oldest) for unit, oldest in items]


def units_from_json(payload) -> list:
  """The inverse of `units_to_json`; a checkpoint of an earlier release holds single episodes."""
  return [([Episode.from_json(e) for e in (unit if isinstance(unit, list) else [unit])], oldest)
          for unit, oldest in payload]


class AsyncCollector:
  """Worker threads that keep episodes running under admission control, into a `TrajectoryBuffer`.

  The unit of admission, buffering and staleness is a group (`prompts.group_size` episodes of one
  prompt, run by one worker; a single episode when the size is 1): a batch holds whole groups, and a
  group too stale is dropped whole. The buffer holds lists of episodes.
  """

  def __init__(self, runner: EpisodeRunner, prompts: PromptSource, admission: AdmissionControl,
               buffer: TrajectoryBuffer, *, workers: int, weights_version):
    self.runner, self.prompts, self.admission, self.buffer = runner, prompts, admission, buffer
    self.weights_version = weights_version       # () -> version the servers hold now
    self._workers = workers
    self._lock = threading.Lock()                # data position, in-flight set and buffer move together
    self._in_flight: dict[int, dict] = {}
    self._next_id = 0
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self.error: BaseException | None = None

  def start(self) -> None:
    self._threads = [threading.Thread(target=self._work, daemon=True, name=f"rollout-{i}")
                     for i in range(self._workers)]
    for thread in self._threads:
      thread.start()

  def _work(self) -> None:
    try:
      while self.admission.wait_to_start(self.weights_version, self._stop):
        with self._lock:
          unit_id, self._next_id = self._next_id, self._next_id + 1
          records = self.prompts.next_group()
          self._in_flight[unit_id] = records
        episodes = [self.runner.run(record) for record in records]
        with self._lock:
          self.buffer.put(episodes, min(e.oldest_version for e in episodes))
          del self._in_flight[unit_id]
    except BaseException as err:  # noqa: BLE001 - handed to the trainer through the buffer
      if not self._stop.is_set():
        self.error = self.error or err
        self.buffer.fail(err)
        self.request_stop()

  def take(self, n: int, learner_version: int):
    """(units, staleness) of `n` buffered units (lists of episodes); raises a worker's error instead
    of waiting."""
    dropped_before = self.buffer.dropped
    try:
      return self.buffer.take(n, learner_version)
    finally:
      self.admission.on_dropped(self.buffer.dropped - dropped_before)

  def state(self) -> dict:
    """Checkpointable: data position (in-flight prompts re-queued) and the buffered episodes."""
    with self._lock:
      in_flight = [record for records in self._in_flight.values() for record in records]
      return {"data": self.prompts.state(in_flight), "buffer": units_to_json(self.buffer.items())}

  def request_stop(self) -> None:
    """Workers start no new episode; those in flight end when the pool closes."""
    self._stop.set()
    self.admission.wake()

  def stop(self) -> None:
    self.request_stop()
    for thread in self._threads:
      thread.join(timeout=60)
