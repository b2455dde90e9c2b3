"""What the trainer needs when the learner spans several processes (hosts) joined by `jax.distributed`.

Each process collects its own share of every batch (its shard of the prompts) and
feeds it as process-local rows of the global batch; process 0 (the chief) writes
files, logs metrics and pushes weights to shared servers. With one process every
function here is a no-op or the identity.
"""

from __future__ import annotations

import itertools
import json

import jax
import numpy as np
from jax.experimental import multihost_utils


def is_chief() -> bool:
  return jax.process_index() == 0


BARRIER_TIMEOUT_S = 6 * 3600
_barriers = itertools.count()


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
  """Every process waits here until all have arrived.

  A barrier of the coordination service, not a collective: the chief may arrive minutes after the
  others (it evaluates, saves and pushes alone), and a process that waits that long inside a CPU
  collective instead fails when Gloo's context setup times out after 30 s (the cause of the
  two-process trainer test's failures on a loaded machine). Every process calls the barriers in the
  same order, so the running count makes each name unique.
  """
  if jax.process_count() == 1:
    return
  from jax._src import distributed  # the runtime `jax.distributed.initialize` started
  client = distributed.global_state.client
  key = f"copc_jax/{next(_barriers)}/{name}"
  if client is None:                   # not started by jax.distributed (e.g. a launcher of its own)
    multihost_utils.sync_global_devices(key)
    return
  client.wait_at_barrier(key, int(timeout_s * 1000))


def gather_json(value) -> list:
  """`value` (JSON-serialisable) of every process, in process order."""
  if jax.process_count() == 1:
    return [value]
  payload = np.frombuffer(json.dumps(value).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([payload.size], np.int64))
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:payload.size] = payload
  rows = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(row[:int(n)]).decode()) for row, n in zip(rows, lengths.reshape(-1), strict=True)]


def sum_over_processes(values: np.ndarray) -> np.ndarray:
  values = np.asarray(values, np.float64)
  if jax.process_count() == 1:
    return values
  return multihost_utils.process_allgather(values).reshape(jax.process_count(), *values.shape).sum(0)


def max_over_processes(value: float) -> float:
  if jax.process_count() == 1:
    return value
  return float(multihost_utils.process_allgather(np.array([value], np.float64)).max())


def fully_replicated_host_copy(tree):
  """The whole value of every array of `tree` on this host (gathers shards held by other processes)."""
  if jax.process_count() == 1:
    return tree
  return multihost_utils.process_allgather(tree, tiled=True)


def global_batch(batch, sharding):
  """Process-local rows (numpy) → global arrays laid out by `sharding` (the batch axis spans processes)."""
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)
