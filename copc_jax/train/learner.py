"""One learner step: recompute π_prox and V, estimate advantages, minibatch actor/critic updates.

    learner = Learner(actor, critic, LearnerConfig(...), mesh=mesh)
    metrics = learner.train_step(batch)          # one jitted, sharded, donated call

Inside the step:
  1. log π_prox(y_t) and V_t with the current weights (no gradient), π under the
     rollouts' sampling settings (`copc_jax.sampling`: temperature, top-k, top-p);
  2. `coupled_advantages` with the preset's estimator, optional whitening;
  3. `epochs` × `num_minibatches` updates of the actor (preset's actor loss) and
     of the critic (clipped value loss), each with its own AdamW.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from copc_jax import estimators, losses, sharding
from copc_jax.presets import EstimatorConfig
from copc_jax.sampling import SamplingParams, token_logprobs_and_entropy
from copc_jax.train import multihost
from copc_jax.train.batch import TrajectoryBatch


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = 1e-5
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  warmup_steps: int = 0
  decay_steps: int = 0        # cosine decay to 10% after warm-up; 0 keeps the rate constant
  b1: float = 0.9
  b2: float = 0.999

  def __post_init__(self):
    if self.learning_rate <= 0:
      raise ValueError(f"learning_rate must be > 0; got {self.learning_rate}")
    if self.max_grad_norm <= 0:
      raise ValueError(f"max_grad_norm must be > 0; got {self.max_grad_norm}")
    if self.warmup_steps < 0 or self.decay_steps < 0:
      raise ValueError("warmup_steps and decay_steps must be >= 0")

  def schedule(self) -> optax.Schedule:
    if self.decay_steps:
      return optax.warmup_cosine_decay_schedule(
          0.0, self.learning_rate, max(self.warmup_steps, 1), self.warmup_steps + self.decay_steps,
          end_value=0.1 * self.learning_rate)
    if self.warmup_steps:
      return optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps)
    return optax.constant_schedule(self.learning_rate)

  def make(self) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(self.max_grad_norm),
                       optax.adamw(self.schedule(), b1=self.b1, b2=self.b2,
                                   weight_decay=self.weight_decay))


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  estimator: EstimatorConfig = EstimatorConfig()
  actor: losses.ActorLossConfig = losses.ActorLossConfig()
  value: losses.ValueLossConfig = losses.ValueLossConfig()
  actor_optimizer: OptimizerConfig = OptimizerConfig()
  critic_optimizer: OptimizerConfig = OptimizerConfig()
  epochs: int = 1
  num_minibatches: int = 1
  sampling: SamplingParams = SamplingParams()   # π_prox and π_θ under the rollouts' sampling settings

  def __post_init__(self):
    if self.epochs < 1 or self.num_minibatches < 1:
      raise ValueError(f"epochs and num_minibatches must be >= 1; got {self.epochs}, "
                       f"{self.num_minibatches}")


def state_values(critic, batch: TrajectoryBatch):
  """V_t = value of the state before y_t: the critic's output at position t − 1."""
  v = critic(batch.tokens, attention_mask_bt=batch.attention_mask)
  return jnp.concatenate([jnp.zeros_like(v[:, :1]), v[:, :-1]], axis=1)


def _global_norm(tree):
  return optax.global_norm(jax.tree.leaves(tree))


def _take(batch: TrajectoryBatch, extra: dict, index):
  return jax.tree.map(lambda x: x[index], batch), jax.tree.map(lambda x: x[index], extra)


def _train_step(models, batch: TrajectoryBatch, rng, config: LearnerConfig):
  actor, critic, actor_opt, critic_opt = models
  logits = actor(batch.tokens, attention_mask_bt=batch.attention_mask)
  logp_prox, entropy_prox = token_logprobs_and_entropy(logits, batch.tokens, config.sampling)
  old_values = state_values(critic, batch)
  logp_prox, old_values = jax.lax.stop_gradient((logp_prox, old_values))
  advantages, returns = estimators.coupled_advantages(
      batch.rewards, old_values, logp_prox, batch.behavior_logprobs, batch.mask,
      **config.estimator.estimator_kwargs())
  if config.estimator.whiten_advantages:
    advantages = estimators.whiten(advantages, batch.mask)
  extra = dict(logp_prox=logp_prox, old_values=old_values, advantages=advantages, returns=returns)

  def actor_loss_fn(actor, mb, mb_extra):
    logits = actor(mb.tokens, attention_mask_bt=mb.attention_mask)
    logp, entropy = token_logprobs_and_entropy(logits, mb.tokens, config.sampling)
    return losses.actor_loss(logp, mb_extra["logp_prox"], mb.behavior_logprobs,
                             mb_extra["advantages"], mb.mask, config.actor, entropy=entropy)

  def critic_loss_fn(critic, mb, mb_extra):
    return losses.value_loss(state_values(critic, mb), mb_extra["old_values"], mb_extra["returns"],
                             mb.mask, config.value)

  # Leaves are immutable arrays: they keep the pre-update values while the Variables move on.
  actor_params_before = jax.tree.leaves(nnx.state(actor, nnx.Param))
  batch_size = batch.tokens.shape[0]
  minibatch = batch_size // config.num_minibatches
  history = []
  for epoch_rng in jax.random.split(rng, config.epochs):
    order = jax.random.permutation(epoch_rng, batch_size)
    for i in range(config.num_minibatches):
      mb, mb_extra = _take(batch, extra, order[i * minibatch:(i + 1) * minibatch])
      (_, actor_diag), actor_grads = nnx.value_and_grad(actor_loss_fn, has_aux=True)(actor, mb, mb_extra)
      (_, value_diag), critic_grads = nnx.value_and_grad(critic_loss_fn, has_aux=True)(critic, mb,
                                                                                       mb_extra)
      actor_opt.update(actor, actor_grads)
      critic_opt.update(critic, critic_grads)
      history.append({**actor_diag, **value_diag, "actor_grad_norm": _global_norm(actor_grads),
                      "critic_grad_norm": _global_norm(critic_grads)})
  metrics = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *history)
  actor_params = jax.tree.leaves(nnx.state(actor, nnx.Param))
  metrics["actor_param_norm"] = _global_norm(actor_params)
  metrics["actor_update_norm"] = _global_norm(
      [after - before for after, before in zip(actor_params, actor_params_before, strict=True)])
  metrics["returns_mean"] = losses.aggregate(returns, batch.mask, "token_mean")
  # Entropy of π_prox (the weights before this update) on the batch's policy tokens: a collapse sign.
  metrics["entropy"] = losses.aggregate(entropy_prox, batch.mask, "token_mean")
  return metrics


class Learner:
  """Owns the actor, the critic and their optimizers; `train_step` is one jitted call."""

  def __init__(self, actor, critic, config: LearnerConfig, *, mesh=None,
               rules=sharding.DEFAULT_RULES, seed: int = 0):
    self.config = config
    self.mesh = mesh
    self.rules = rules
    actor_opt = nnx.Optimizer(actor, config.actor_optimizer.make(), wrt=nnx.Param)
    critic_opt = nnx.Optimizer(critic, config.critic_optimizer.make(), wrt=nnx.Param)
    self.graphdef, state = nnx.split((actor, critic, actor_opt, critic_opt))
    self.rng = jax.random.key(seed)
    if mesh is None:
      self.state = state
      self._step = jax.jit(self._functional_step, donate_argnums=(0,))
    else:
      state_shardings = sharding.state_shardings(state, mesh, rules)
      self.state = jax.device_put(state, state_shardings)
      self._batch_sharding = sharding.batch_sharding(mesh, rules)
      self._step = jax.jit(
          self._functional_step, donate_argnums=(0,),
          in_shardings=(state_shardings, self._batch_sharding, sharding.replicated(mesh)),
          out_shardings=(state_shardings, sharding.replicated(mesh)))

  def _functional_step(self, state, batch, rng):
    models = nnx.merge(self.graphdef, state)
    metrics = _train_step(models, batch, rng, self.config)
    return nnx.state(models), metrics

  @property
  def actor(self):
    return nnx.merge(self.graphdef, self.state)[0]

  @property
  def critic(self):
    return nnx.merge(self.graphdef, self.state)[1]

  def train_step(self, batch: TrajectoryBatch, *, process_local: bool = False) -> dict:
    """One update on `batch`: the global batch, or with `process_local` this process's rows of it."""
    rows = batch.tokens.shape[0] * (jax.process_count() if process_local else 1)
    if rows % self.config.num_minibatches:
      raise ValueError(f"batch size {rows} is not divisible by num_minibatches {self.config.num_minibatches}")
    if process_local and jax.process_count() > 1:
      if self.mesh is None:
        raise ValueError("a batch spread over processes needs a mesh")
      batch = multihost.global_batch(batch, self._batch_sharding)
    elif self.mesh is not None:
      batch = jax.device_put(batch, self._batch_sharding)
    self.rng, step_rng = jax.random.split(self.rng)
    self.state, metrics = self._step(self.state, batch, step_rng)
    return metrics
