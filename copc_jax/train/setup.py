"""The trainer's settings: `config.model` (`ModelSource`), `config.trainer` (`TrainerConfig`),
`config.warm_start` (`WarmStartConfig`), and the learner's settings derived from a job config.

Loads without JetStream, gRPC or the trainer (`tests/test_config.py` checks).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from copc_jax.models.attention import check_implementation
from copc_jax.models.decoder import remat_policy_name
from copc_jax.train.learner import LearnerConfig, OptimizerConfig

MODES = ("sync", "async", "lag")


# The trackers beside metrics.jsonl (`train/metrics.py` writes them); defined here so that loading a
# config does not import them (tensorboardX pulls Cloud Storage and gRPC where they are installed).
TRACKERS = ("tensorboard", "wandb")


def cudnn_attention_available() -> bool:
  """Whether this process's GPU runs cuDNN's fused attention: compute capability 8.0 (Ampere) or newer
  (cuDNN's support matrix); a T4 (7.5) takes XLA's."""
  try:
    return float(jax.devices("gpu")[0].compute_capability) >= 8.0
  except (RuntimeError, AttributeError, ValueError, IndexError):
    return False


@dataclasses.dataclass(frozen=True)
class ModelSource:
  checkpoint: str = "tiny"      # a Hugging Face directory (config.json + safetensors), or "tiny"
  tiny_arch: str = "qwen2"      # for "tiny": built in the workdir from the seed
  tokenizer: str = ""           # a directory with tokenizer files; "" = the checkpoint's own
  # How the learner's models compute (models/decoder.py): "auto" = bfloat16 on accelerators,
  # float32 on the CPU; master weights in param_dtype.
  dtype: str = "auto"
  param_dtype: str = "float32"
  remat: str = "none"           # none | full | dots | dots_saveable
  scan_layers: bool = False     # one lax.scan over the blocks: compile time independent of depth
  attention: str = "auto"       # auto (reference on CPU, splash on TPU, cudnn on an Ampere+ GPU in half
                                # precision, else xla) | reference | xla | cudnn | splash

  def __post_init__(self):
    if self.tiny_arch not in ("qwen2", "qwen3", "llama"):
      raise ValueError(f"tiny_arch must be 'qwen2', 'qwen3' or 'llama'; got {self.tiny_arch!r}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"model.{name} must be 'auto', 'float32' or 'bfloat16'; got {getattr(self, name)!r}")
    remat_policy_name(self.remat)
    if self.attention != "auto":
      check_implementation(self.attention)

  def compute_options(self, platform: str | None = None) -> dict:
    """The keyword arguments of `Decoder` / `hf_io.from_pretrained` on `platform` (default: jax's)."""
    platform = platform or jax.default_backend()
    pick = lambda value, on_cpu, elsewhere: value if value != "auto" else (on_cpu if platform == "cpu"
                                                                           else elsewhere)
    dtype = jnp.dtype(pick(self.dtype, "float32", "bfloat16"))
    # cuDNN's fused kernel takes half precision on Ampere or newer only; on an H200 it ran the learner
    # step 1.28× as fast as XLA's attention, at the error of XLA's against the float32 reference (one
    # run of both: experiments/device_check_attention.json)
    cudnn = platform == "gpu" and dtype.itemsize == 2 and cudnn_attention_available()
    accelerated = {"tpu": "splash", "gpu": "cudnn" if cudnn else "xla"}.get(platform, "xla")
    attention = pick(self.attention, "reference", accelerated)
    return dict(dtype=dtype,
                param_dtype=jnp.dtype("float32" if self.param_dtype == "auto" else self.param_dtype),
                remat=self.remat, scan_layers=self.scan_layers, attention=attention)


def learner_config(config) -> LearnerConfig:
  """The learner's settings from the typed job config (method, optimizers, minibatches, sampling)."""
  c = config.trainer
  make_opt = lambda lr: OptimizerConfig(learning_rate=lr, max_grad_norm=c.max_grad_norm,
                                        warmup_steps=c.warmup_steps, name=c.optimizer,
                                        options=c.optimizer_options)
  return LearnerConfig(estimator=config.estimator, actor=config.actor, value=config.value,
                       actor_optimizer=make_opt(c.actor_learning_rate),
                       critic_optimizer=make_opt(c.critic_learning_rate),
                       epochs=c.epochs, num_minibatches=c.num_minibatches,
                       sampling=config.rollout.sampling, logits_chunk=c.logits_chunk,
                       forward_microbatches=c.forward_microbatches,
                       gradient_accumulation=c.gradient_accumulation)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  mode: str = "async"
  steps: int = 60
  batch_size: int = 32
  max_staleness: int = 4         # async: η
  sync_every: int = 1            # async: push weights every this many updates
  lag: int = 0                   # lag: k
  eval_every: int = 20           # 0: evaluate only before and after training
  checkpoint_every: int = 10
  epochs: int = 1
  num_minibatches: int = 4        # updates per batch: the PPO clip binds from the second one on
  critic_warmup_steps: int = 10   # value-only updates on the start policy's rollouts before the actor moves
  group_size: int = 1             # samples per prompt (the group presets' baseline needs >= 2)
  logits_chunk: int = 0           # > 0: log π over this many positions at a time (no [B, T, V] logits)
  forward_microbatches: int = 1   # the no-gradient passes over the batch in this many row groups
  gradient_accumulation: int = 1  # each minibatch's gradient summed over this many row groups (same
                                  # gradient, the activations of one group)
  pad_to_multiple: int = 0        # > 0: batches padded to their longest row rounded up to this, not to
                                  # rollout.max_length (one process; several pad to max_length)
  actor_learning_rate: float = 1e-4
  critic_learning_rate: float = 1e-3
  max_grad_norm: float = 1.0
  warmup_steps: int = 0
  optimizer: str = "adamw"                            # any optax optimizer, by name ...
  optimizer_options: tuple[tuple[str, Any], ...] = ()  # ... and its other arguments: (("b2", 0.95),)
  progress_bar: bool = True
  trackers: tuple[str, ...] = ("tensorboard",)   # besides metrics.jsonl: "tensorboard", "wandb"
  wandb_project: str = "copc_jax"

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}; got {self.mode!r}")
    unknown = [t for t in self.trackers if t not in TRACKERS]
    if unknown:
      raise ValueError(f"trackers must be among {TRACKERS}; got {tuple(self.trackers)}")
    for name in ("steps", "batch_size", "sync_every", "checkpoint_every", "epochs", "num_minibatches",
                 "group_size", "forward_microbatches", "gradient_accumulation"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
    for name in ("max_staleness", "lag", "eval_every", "warmup_steps", "critic_warmup_steps", "pad_to_multiple",
                 "logits_chunk"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
    if self.mode == "async" and self.max_staleness < self.sync_every - 1:
      raise ValueError(f"max_staleness ({self.max_staleness}) must be >= sync_every - 1 "
                       f"({self.sync_every - 1}): weights pushed every {self.sync_every} updates are that "
                       f"stale")
    if self.batch_size % self.group_size:
      raise ValueError(f"batch_size ({self.batch_size}) must be divisible by group_size ({self.group_size}): "
                       f"a batch holds whole groups")
    if self.batch_size % self.num_minibatches:
      raise ValueError(f"batch_size ({self.batch_size}) must be divisible by num_minibatches "
                       f"({self.num_minibatches})")
    if (self.batch_size // self.num_minibatches) % self.gradient_accumulation:
      raise ValueError(f"a minibatch of {self.batch_size // self.num_minibatches} rows (batch_size / "
                       f"num_minibatches) must be divisible by gradient_accumulation "
                       f"({self.gradient_accumulation})")
    for name in ("actor_learning_rate", "critic_learning_rate", "max_grad_norm"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
    OptimizerConfig(learning_rate=self.actor_learning_rate, name=self.optimizer,
                    options=self.optimizer_options)       # an unknown optimizer or option: one line now


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
  steps: int = 0                     # 0: no warm start
  batch_size: int = 32
  learning_rate: float = 3e-3
  warmup_steps: int = 20

  def __post_init__(self):
    if self.steps < 0 or self.batch_size < 1 or self.warmup_steps < 0:
      raise ValueError(f"need steps >= 0, batch_size >= 1, warmup_steps >= 0; got {self.steps}, "
                       f"{self.batch_size}, {self.warmup_steps}")
    if self.learning_rate <= 0:
      raise ValueError(f"learning_rate must be > 0; got {self.learning_rate}")
