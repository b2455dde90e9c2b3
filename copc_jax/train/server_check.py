"""The learner checks its rollout servers before the first rollout.

Every server answers `Status` with its limits and the configuration of the model it serves. A
server whose prompt bucket or total length is smaller than the learner's rollout config assumes
would truncate or refuse requests mid-run; one serving another model would produce behaviour
log-probs of the wrong policy. Both are refused here, with one line naming the server, the field
and both values.
"""

from __future__ import annotations

import dataclasses
import json

from copc_jax.rollout.protocol import ServerStatus

LIMITS = ("max_prefill_length", "max_length")


class ServerMismatch(ValueError):
  """A server cannot serve what the learner assumes."""


def model_fields(model_config) -> dict:
  """The architecture as a server reports it (JSON types: tuples become lists)."""
  return json.loads(json.dumps(dataclasses.asdict(model_config)))


def check_servers(statuses: list[ServerStatus], rollout, model_config) -> None:
  """`statuses`: the backend's `status()`; servers that do not answer now are checked when they do not
  matter (they take no requests until they answer, and then serve the same process's weights)."""
  expected = model_fields(model_config)
  for server in statuses:
    status = server.report
    if not server.healthy or "max_length" not in status:
      continue
    where = f"rollout server {server.address}"
    for field in LIMITS:
      if status[field] < getattr(rollout, field):
        raise ServerMismatch(f"{where} has {field} {status[field]}, less than config.rollout.{field} "
                             f"{getattr(rollout, field)}: start it with --{field}={getattr(rollout, field)} "
                             f"(tpu_scripts/start_servers.sh takes it from the config)")
    served = status.get("model")
    if served is None:
      raise ServerMismatch(f"{where} does not report the model it serves (an older server): update it")
    for field, value in expected.items():
      if served.get(field) != value:
        raise ServerMismatch(f"{where} serves a different model: {field} is {served.get(field)!r} there and "
                             f"{value!r} in the learner's checkpoint")
