"""`config.rollout`: the rollout backend, its servers, the sampling settings and the episode limits.

Loads without JetStream, gRPC or the trainer (`tests/test_config.py` checks).
"""

from __future__ import annotations

import dataclasses
import importlib.util

from copc_jax.rollout.protocol import WEIGHT_TRANSFERS
from copc_jax.sampling import SamplingParams

SERVER_PLATFORMS = ("cpu", "tpu", "cuda", "rocm", "")
BACKENDS = ("jetstream", "in_process")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  backend: str = "jetstream"            # "jetstream": a pool of JetStream server processes; "in_process":
                                        # generated in the learner's process on its devices (one host)
  in_process_steps: int = 32            # in_process: decode steps per device call (new requests join between)
  num_servers: int = 2                  # local JetStream servers started as subprocesses
  addresses: tuple[str, ...] = ()       # or remote servers (host:port); then num_servers is ignored
  eval_addresses: tuple[str, ...] = ()  # lag mode with remote servers: a server for evaluations
  auth_token_file: str = ""             # remote servers' shared token ("": $COPC_AUTH_TOKEN, if set)
  tls_root_certificates: str = ""       # remote servers' CA (PEM file): talk to them over TLS
  server_platform: str = "cpu"          # JAX platform of the local servers ("" = this environment's)
  server_tensor_parallelism: int = -1   # devices each local server splits the model over (-1: all)
  server_data_parallelism: int = 1      # device groups each local server splits its slots over
  server_decode_steps: int = 1          # tokens each local server decodes per slot in one engine call
  server_dtype: str = "float32"        # local servers' weights, compute and KV cache (or "bfloat16")
  weight_transfer: str = "path"         # "path": servers read each version from the workdir (shared
                                        # filesystem); "stream": its file's bytes go to them over gRPC;
                                        # "memory": bytes serialized in memory, nothing on disk (lag
                                        # mode's saved versions are streamed from disk); "shm": written
                                        # to shared memory (/dev/shm), read there by servers on this
                                        # machine (the fastest; lag mode's saved versions go by path)
  slots: int = 8                        # concurrent generations per server
  max_prefill_length: int = 64          # prompt bucket (every turn's context must fit)
  max_length: int = 128                 # context + generated tokens
  max_in_flight: int = 8                # requests per server at a time
  max_turns: int = 3
  max_tokens_per_turn: int = 48
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  workers: int = 0                      # concurrent episodes; 0: max_in_flight × servers
  ready_timeout_s: float = 300.0
  stall_timeout_s: float = 10.0         # a generation silent this long makes the pool probe its server
  probe_timeout_s: float = 5.0          # ... which is hung if Status gets no answer within this
  lost_timeout_s: float = 120.0         # a generation silent this long on a server that answers: resubmitted
  push_timeout_s: float = 300.0         # a weight push unfinished by then: the server is out until it answers

  def __post_init__(self):
    if self.server_platform not in SERVER_PLATFORMS:
      raise ValueError(f"server_platform must be one of {SERVER_PLATFORMS}; got {self.server_platform!r}")
    if self.server_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"server_dtype must be 'float32' or 'bfloat16'; got {self.server_dtype!r}")
    if self.server_decode_steps < 1:
      raise ValueError(f"server_decode_steps must be >= 1; got {self.server_decode_steps}")
    if self.server_data_parallelism < 1:
      raise ValueError(f"server_data_parallelism must be >= 1; got {self.server_data_parallelism}")
    if self.server_tensor_parallelism == 0 or self.server_tensor_parallelism < -1:
      raise ValueError(f"server_tensor_parallelism must be -1 (all devices) or >= 1; got "
                       f"{self.server_tensor_parallelism}")
    if self.backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}; got {self.backend!r}")
    if self.in_process_steps < 1:
      raise ValueError(f"in_process_steps must be >= 1; got {self.in_process_steps}")
    if self.weight_transfer not in WEIGHT_TRANSFERS:
      raise ValueError(f"weight_transfer must be 'path', 'stream', 'memory' or 'shm'; got "
                       f"{self.weight_transfer!r}")
    if not self.addresses and self.num_servers < 1:
      raise ValueError(f"num_servers must be >= 1 (or give addresses); got {self.num_servers}")
    for name in ("slots", "max_in_flight", "max_turns", "max_tokens_per_turn"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
    if self.max_length <= self.max_prefill_length:
      raise ValueError(f"max_length ({self.max_length}) must exceed max_prefill_length "
                       f"({self.max_prefill_length})")
    _ = self.sampling   # validates temperature, top_p, top_k
    for name in ("ready_timeout_s", "stall_timeout_s", "probe_timeout_s", "lost_timeout_s", "push_timeout_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
    if self.lost_timeout_s < self.stall_timeout_s:
      raise ValueError(f"lost_timeout_s ({self.lost_timeout_s}) must be >= stall_timeout_s "
                       f"({self.stall_timeout_s})")

  def check_installed(self) -> None:
    """Local JetStream servers need the `jetstream` package, which is installed apart (README, Install)."""
    if self.backend == "jetstream" and importlib.util.find_spec("jetstream") is None:
      raise ValueError("config.rollout.backend = 'jetstream' runs JetStream servers, but JetStream is not "
                       "installed: pip install --no-deps google-jetstream==0.2.2 (README, Install), or use "
                       "--config.rollout.backend=in_process")

  @property
  def sampling(self) -> SamplingParams:
    """The sampling distribution of every rollout, and of the learner's π_prox and π_θ."""
    return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

  @property
  def concurrency(self) -> int:
    return self.workers or self.max_in_flight * max(len(self.addresses) or self.num_servers, 1)
