"""One learner step: recompute π_prox and V, estimate advantages, minibatch actor/critic updates.

    learner = Learner(actor, critic, LearnerConfig(...), mesh=mesh)
    metrics = learner.train_step(batch)          # one jitted, sharded, donated call

Inside the step:
  1. log π_prox(y_t) and V_t with the current weights (no gradient), π under the
     rollouts' sampling settings (`copc_jax.sampling`: temperature, top-k, top-p);
  2. `coupled_advantages` with the preset's estimator (or, for the critic-free group presets,
     `group_advantages` of the sequences' outcome rewards), then whitening by the spec's rule
     (`estimators.whiten`: none | scale | center, the baseline scaled by the ratio the advantage
     channel carries);
  3. `epochs` × `num_minibatches` updates of the actor (preset's actor loss, with the KL term to a
     frozen reference when `kl_coef > 0`) and of the critic (clipped value loss), each with its
     own optimizer, as one `lax.scan`; each minibatch's gradient optionally accumulated over
     `gradient_accumulation` row groups (the same gradient, the activations of one group).
     `critic_step` runs the same with the actor held still (the
     critic warm-up); group presets train no critic.

The metrics say what moves before a failure: the advantages before whitening (mean, std, min,
max), the returns, KL(μ‖π_prox) (k3, from μ's own samples) and the behaviour ratio's extremes
over the whole batch; clip fraction, mask fraction, value loss and explained variance averaged over
the minibatch updates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from copc_jax import estimators, losses, sharding
from copc_jax.presets import EstimatorConfig
from copc_jax.sampling import SamplingParams, token_logprobs_and_entropy, token_logprobs_and_entropy_chunked
from copc_jax.train import multihost
from copc_jax.train.batch import TrajectoryBatch


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Gradient clipping, then the optax transform `name` with the learning-rate schedule and
  `options` (its other arguments, as (name, value) pairs), e.g. name="adamw",
  options=(("b2", 0.95), ("weight_decay", 0.01))."""

  learning_rate: float = 1e-5
  max_grad_norm: float = 1.0
  warmup_steps: int = 0
  decay_steps: int = 0        # cosine decay to 10% after warm-up; 0 keeps the rate constant
  name: str = "adamw"
  options: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    if self.learning_rate <= 0:
      raise ValueError(f"learning_rate must be > 0; got {self.learning_rate}")
    if self.max_grad_norm <= 0:
      raise ValueError(f"max_grad_norm must be > 0; got {self.max_grad_norm}")
    if self.warmup_steps < 0 or self.decay_steps < 0:
      raise ValueError("warmup_steps and decay_steps must be >= 0")
    transform = getattr(optax, self.name, None)
    if not callable(transform) or "learning_rate" not in inspect.signature(transform).parameters:
      raise ValueError(f"optimizer must name an optax optimizer that takes a learning_rate (e.g. adamw, adam, "
                       f"sgd, lion, adafactor); got {self.name!r}")
    try:
      inspect.signature(transform).bind(learning_rate=self.learning_rate, **dict(self.options))
    except TypeError as err:
      allowed = [p for p in inspect.signature(transform).parameters if p != "learning_rate"]
      raise ValueError(f"optimizer_options {dict(self.options)} do not fit optax.{self.name} ({err}); its "
                       f"options: {allowed}") from None

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
                       getattr(optax, self.name)(learning_rate=self.schedule(), **dict(self.options)))


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
  logits_chunk: int = 0     # > 0: log π and entropy over this many positions at a time (no [B, T, V])
  forward_microbatches: int = 1   # the no-gradient passes (π_prox, V, π_ref) over this many row groups
  gradient_accumulation: int = 1  # each minibatch's gradients summed over this many row groups

  def __post_init__(self):
    if self.epochs < 1 or self.num_minibatches < 1:
      raise ValueError(f"epochs and num_minibatches must be >= 1; got {self.epochs}, "
                       f"{self.num_minibatches}")
    for name in ("forward_microbatches", "gradient_accumulation"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
    if self.logits_chunk < 0:
      raise ValueError(f"logits_chunk must be >= 0 (0: the whole sequence at once); got {self.logits_chunk}")


def policy_logprobs_and_entropy(actor, batch: TrajectoryBatch, config: LearnerConfig):
  """log π(y_t) and the entropy of π under the sampling settings, [B, T] each (position 0: 0)."""
  if not config.logits_chunk:
    logits = actor(batch.tokens, attention_mask_bt=batch.attention_mask)
    return token_logprobs_and_entropy(logits, batch.tokens, config.sampling)
  hidden = actor.model(batch.tokens, attention_mask_bt=batch.attention_mask)
  return token_logprobs_and_entropy_chunked(hidden, actor.logits, batch.tokens, config.sampling,
                                            chunk=config.logits_chunk)


def _row_groups(tree, groups: int, name: str):
  """Every leaf [B, ...] as [groups, B / groups, ...]; group g holds rows g, g + groups, ... so each
  group keeps rows of every data shard."""
  b = jax.tree.leaves(tree)[0].shape[0]
  if b % groups:
    raise ValueError(f"{b} rows are not divisible by {name} {groups}")
  return jax.tree.map(lambda x: x.reshape(b // groups, groups, *x.shape[1:]).swapaxes(0, 1), tree)


def _by_row_groups(fn, batch: TrajectoryBatch, groups: int):
  """`fn(batch)` for per-row outputs [B, ...], computed over `groups` groups of rows one after another
  (`lax.map`): the peak memory of one group."""
  if groups == 1:
    return fn(batch)
  b = batch.tokens.shape[0]
  out = jax.lax.map(fn, _row_groups(batch, groups, "forward_microbatches"))
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(b, *x.shape[2:]), out)


def _combine_diagnostics(diagnostics_g: dict, shares_g) -> dict:
  """One minibatch's diagnostics from its row groups': extremes and counts exactly, every other
  entry as the groups' share-weighted mean (groups whose value is undefined, NaN, left out)."""
  def combine(name, x_g):
    if name.endswith("_max"):
      return x_g.max()
    if name.endswith("_min"):
      return x_g.min()
    if name.endswith("_count"):
      return x_g.sum()
    defined_g = jnp.isfinite(x_g)
    weights_g = jnp.where(defined_g, shares_g, 0.0)
    return jnp.where(defined_g.any(), jnp.where(defined_g, x_g, 0.0) @ weights_g
                     / jnp.maximum(weights_g.sum(), 1e-30), jnp.nan)
  return {name: combine(name, x_g) for name, x_g in diagnostics_g.items()}


def accumulated_value_and_grad(loss_fn, model, mb: TrajectoryBatch, mb_extra: dict, *, groups: int,
                               aggregation: str, with_grad: bool = True):
  """(diagnostics, ∇ loss) of `loss_fn(model, mb, mb_extra) -> (loss, diagnostics)` on one minibatch,
  computed over `groups` row groups one after another (gradient accumulation: the activations of
  one group at a time):

      ∇L = Σ_g w_g ∇L_g,   w_g = `losses.aggregation_shares` of the groups' policy masks,

  exact for every aggregation of `losses.aggregate`. `with_grad = False`: the diagnostics alone
  (gradient None)."""
  if groups == 1:
    if not with_grad:
      return loss_fn(model, mb, mb_extra)[1], None
    (_, diagnostics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, mb, mb_extra)
    return diagnostics, grads
  grouped, grouped_extra = _row_groups((mb, mb_extra), groups, "gradient_accumulation")
  shares_g = losses.aggregation_shares(grouped.mask, aggregation)
  graphdef, state = nnx.split(model)

  def one_group(carry, group):        # the weights ride in the carry: NNX merges them at this trace level
    state, total = carry
    rows, rows_extra, share = group
    model = nnx.merge(graphdef, state)
    if not with_grad:
      return carry, loss_fn(model, rows, rows_extra)[1]
    (_, diagnostics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, rows, rows_extra)
    return (state, jax.tree.map(lambda t, g: t + share * g, total, grads)), diagnostics

  zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)) if with_grad else None
  (_, grads), diagnostics_g = jax.lax.scan(one_group, (state, zeros), (grouped, grouped_extra, shares_g))
  return _combine_diagnostics(diagnostics_g, shares_g), grads


def state_values(critic, batch: TrajectoryBatch):
  """V_t = value of the state before y_t: the critic's output at position t − 1."""
  v = critic(batch.tokens, attention_mask_bt=batch.attention_mask)
  return jnp.concatenate([jnp.zeros_like(v[:, :1]), v[:, :-1]], axis=1)


def _global_norm(tree):
  return optax.global_norm(jax.tree.leaves(tree))


def _take(batch: TrajectoryBatch, extra: dict, index):
  return jax.tree.map(lambda x: x[index], batch), jax.tree.map(lambda x: x[index], extra)


def _masked_summary(x_bt, mask_bt, prefix: str) -> dict:
  """Mean, std, min and max of `x_bt` over `mask_bt`, named `prefix_mean` etc."""
  mean, std, _ = losses.masked_stats(x_bt, mask_bt)
  return {f"{prefix}_mean": mean, f"{prefix}_std": std,
          f"{prefix}_min": jnp.where(mask_bt, x_bt, jnp.inf).min(),
          f"{prefix}_max": jnp.where(mask_bt, x_bt, -jnp.inf).max()}


def advantages_and_returns(batch: TrajectoryBatch, logp_prox, old_values, config: LearnerConfig):
  """(whitened advantages, value targets, metrics): the preset's advantage channel on one batch."""
  estimator = config.estimator
  advantages, returns = estimators.coupled_advantages(
      batch.rewards, old_values, logp_prox, batch.behavior_logprobs, batch.mask,
      **estimator.estimator_kwargs())
  if estimator.group_method:            # one outcome advantage per sequence, on its policy tokens
    per_sequence_b = estimators.group_advantages(batch.rewards.sum(axis=1), batch.group_ids[:, 0],
                                                 method=estimator.group_method)
    advantages = jnp.where(batch.mask, per_sequence_b[:, None], 0.0)
  log_ratio_bt = jnp.where(batch.mask, logp_prox - batch.behavior_logprobs, 0.0)
  ratio_bt = jnp.exp(log_ratio_bt)
  kept_bt = batch.mask & (losses.behavior_weights(ratio_bt, config.actor) != 0)
  metrics = _masked_summary(advantages, batch.mask, "advantage_raw")
  advantages = estimators.whiten(advantages, kept_bt, mode=estimator.whiten,
                                 carried_ratio=jnp.clip(ratio_bt, *estimator.rho_clip),
                                 min_std=estimator.whiten_min_std)
  finite_bt = batch.mask & jnp.isfinite(log_ratio_bt)
  metrics.update({
      "returns_mean": losses.aggregate(returns, batch.mask, "token_mean"),
      # KL(μ‖π_prox) on μ's samples, k3: x − 1 − log x with x = π_prox/μ.
      "kl_behavior_prox": losses.aggregate(jnp.where(finite_bt, ratio_bt - 1.0 - log_ratio_bt, 0.0),
                                           finite_bt, "token_mean"),
      "ratio_batch_min": jnp.where(finite_bt, ratio_bt, jnp.inf).min(),
      "ratio_batch_max": jnp.where(finite_bt, ratio_bt, -jnp.inf).max(),
      "ratio_batch_p99": jnp.nanpercentile(jnp.where(finite_bt, ratio_bt, jnp.nan), 99.0),
  })
  return advantages, returns, metrics


def _train_step(models, batch: TrajectoryBatch, rng, config: LearnerConfig, reference=None,
                update_actor: bool = True):
  """One update. The `epochs` × `num_minibatches` actor and critic updates are one `lax.scan` over
  minibatch index sets, so the compiled program does not grow with either. `reference`: the frozen
  policy of the KL term (`config.actor.kl_coef > 0`); its log-probs come in the same pass as π_prox.
  `update_actor = False`: the critic alone learns (the critic warm-up)."""
  actor, critic, actor_opt, critic_opt = models
  update_critic = not config.estimator.group_method
  logp_prox, entropy_prox, old_values = _by_row_groups(
      lambda rows: (*policy_logprobs_and_entropy(actor, rows, config), state_values(critic, rows)),
      batch, config.forward_microbatches)
  logp_prox, old_values = jax.lax.stop_gradient((logp_prox, old_values))
  advantages, returns, batch_metrics = advantages_and_returns(batch, logp_prox, old_values, config)
  extra = dict(logp_prox=logp_prox, old_values=old_values, advantages=advantages, returns=returns)
  if reference is not None:
    reference_logp = lambda rows: policy_logprobs_and_entropy(reference, rows, config)[0]
    logp_ref = _by_row_groups(reference_logp, batch, config.forward_microbatches)
    extra["logp_ref"] = jax.lax.stop_gradient(logp_ref)

  def actor_loss_fn(actor, mb, mb_extra):
    logp, entropy = policy_logprobs_and_entropy(actor, mb, config)
    return losses.actor_loss(logp, mb_extra["logp_prox"], mb.behavior_logprobs, mb_extra["advantages"],
                             mb.mask, config.actor, entropy=entropy, logp_ref=mb_extra.get("logp_ref"))

  def critic_loss_fn(critic, mb, mb_extra):
    return losses.value_loss(state_values(critic, mb), mb_extra["old_values"], mb_extra["returns"],
                             mb.mask, config.value)

  # Leaves are immutable arrays: they keep the pre-update values while the Variables move on.
  actor_params_before = jax.tree.leaves(nnx.state(actor, nnx.Param))
  batch_size = batch.tokens.shape[0]
  minibatch = batch_size // config.num_minibatches
  orders = jax.vmap(lambda key: jax.random.permutation(key, batch_size))(jax.random.split(rng, config.epochs))
  minibatch_rows = orders.reshape(config.epochs * config.num_minibatches, minibatch)
  graphdef, state = nnx.split(models)

  def update(state, rows):
    actor, critic, actor_opt, critic_opt = nnx.merge(graphdef, state)
    mb, mb_extra = _take(batch, extra, rows)
    diagnostics = {}
    groups = config.gradient_accumulation
    if update_actor:
      actor_diag, actor_grads = accumulated_value_and_grad(actor_loss_fn, actor, mb, mb_extra, groups=groups,
                                                           aggregation=config.actor.aggregation)
      actor_opt.update(actor, actor_grads)
      diagnostics.update(actor_diag, actor_grad_norm=_global_norm(actor_grads))
    # group presets: the critic is only measured
    value_diag, critic_grads = accumulated_value_and_grad(critic_loss_fn, critic, mb, mb_extra, groups=groups,
                                                          aggregation=config.value.aggregation,
                                                          with_grad=update_critic)
    if update_critic:
      critic_opt.update(critic, critic_grads)
    diagnostics.update(value_diag, critic_grad_norm=_global_norm(critic_grads or []))
    return nnx.state((actor, critic, actor_opt, critic_opt)), diagnostics

  state, history = jax.lax.scan(update, state, minibatch_rows)
  nnx.update(models, state)
  metrics = jax.tree.map(lambda x: jnp.mean(x, axis=0), history)
  actor_params = jax.tree.leaves(nnx.state(actor, nnx.Param))
  metrics["actor_param_norm"] = _global_norm(actor_params)
  metrics["actor_update_norm"] = _global_norm(
      [after - before for after, before in zip(actor_params, actor_params_before, strict=True)])
  metrics.update(batch_metrics)
  # Entropy of π_prox (the weights before this update) on the batch's policy tokens: a collapse sign.
  metrics["entropy"] = losses.aggregate(entropy_prox, batch.mask, "token_mean")
  if reference is not None:       # KL(π_prox ‖ π_ref), k3 estimator, on the policy tokens
    log_r = extra["logp_ref"] - logp_prox
    metrics["kl_ref"] = losses.aggregate(jnp.exp(log_r) - log_r - 1.0, batch.mask, "token_mean")
  return metrics


def _step_function(graphdef, reference_graphdef, config: LearnerConfig, kernel_mesh=None):
  """The step as a function of (state, batch, rng, reference state, update_actor): what `jax.jit`
  compiles. `kernel_mesh`: the mesh a Pallas kernel (splash attention) runs under, per shard."""
  def step(state, batch, rng, reference_state=None, update_actor=True):
    models = nnx.merge(graphdef, state)
    reference = None if reference_state is None else nnx.merge(reference_graphdef, reference_state)
    context = (jax.sharding.use_abstract_mesh(kernel_mesh.abstract_mesh) if kernel_mesh is not None
               else contextlib.nullcontext())
    with context:
      metrics = _train_step(models, batch, rng, config, reference, update_actor=update_actor)
    return nnx.state(models), metrics
  return step


def _kernel_mesh(actor, mesh):
  return mesh if mesh is not None and actor.model.attention == "splash" else None


def _optimizers(actor, critic, config: LearnerConfig):
  return (nnx.Optimizer(actor, config.actor_optimizer.make(), wrt=nnx.Param),
          nnx.Optimizer(critic, config.critic_optimizer.make(), wrt=nnx.Param))


def _jit_step(step, state, reference, mesh, rules):
  """`step` jitted with the state donated and placed by the rules over `mesh`."""
  state_shardings = sharding.state_shardings(state, mesh, rules)
  reference_shardings = None if reference is None else sharding.state_shardings(reference, mesh, rules)
  jitted = jax.jit(step, donate_argnums=(0,), static_argnums=(4,),
                   in_shardings=(state_shardings, sharding.batch_sharding(mesh, rules),
                                 sharding.replicated(mesh), reference_shardings),
                   out_shardings=(state_shardings, sharding.replicated(mesh)))
  return jitted, state_shardings, reference_shardings


def lower_train_step(make_models, config: LearnerConfig, mesh, rules=sharding.DEFAULT_RULES, *,
                     batch_size: int, length: int, update_actor: bool = True):
  """The sharded train step lowered for `mesh`'s devices from shapes alone (nothing is allocated):
  `.compile()` gives the compiler's per-device memory plan and FLOPs, e.g. for a TPU slice that is not
  there (`jax.experimental.topologies`). `make_models()` builds (actor, critic); it runs under
  `nnx.eval_shape`. With `config.actor.kl_coef > 0` the step takes the reference copy of the actor."""
  def build():
    actor, critic = make_models()
    return (actor, critic, *_optimizers(actor, critic, config))
  models = nnx.eval_shape(build)
  graphdef, state = nnx.split(models)
  reference_graphdef, reference = nnx.split(models[0]) if config.actor.kl_coef > 0 else (None, None)
  step = _step_function(graphdef, reference_graphdef, config, _kernel_mesh(models[0], mesh))
  jitted, _, _ = _jit_step(step, state, reference, mesh, rules)
  shape = (batch_size, length)
  spec = lambda dtype: jax.ShapeDtypeStruct(shape, dtype)
  batch = TrajectoryBatch(tokens=spec(jnp.int32), attention_mask=spec(jnp.bool_), mask=spec(jnp.bool_),
                          behavior_logprobs=spec(jnp.float32), versions=spec(jnp.int32),
                          rewards=spec(jnp.float32), group_ids=spec(jnp.int32))
  rng = jax.eval_shape(lambda: jax.random.key(0))
  return jitted.lower(state, batch, rng, reference, update_actor)


class Learner:
  """Owns the actor, the critic and their optimizers; `train_step` is one jitted call."""

  def __init__(self, actor, critic, config: LearnerConfig, *, mesh=None,
               rules=sharding.DEFAULT_RULES, seed: int = 0):
    """With `config.actor.kl_coef > 0`, a frozen copy of `actor` as given (the warm-started weights)
    is the KL reference; it is not part of `state` (nor of checkpoints): a resumed run builds it
    from the same weights again."""
    self.config = config
    self.mesh = mesh
    self.rules = rules
    reference, reference_graphdef = None, None
    if config.actor.kl_coef > 0:
      reference_graphdef, reference = nnx.split(actor)
      reference = jax.tree.map(jnp.copy, reference)      # its own buffers: the actor's are donated
    self.graphdef, state = nnx.split((actor, critic, *_optimizers(actor, critic, config)))
    self.rng = jax.random.key(seed)
    step = _step_function(self.graphdef, reference_graphdef, config, _kernel_mesh(actor, mesh))
    if mesh is None:     # committed to one device like the step's outputs (step 2 reuses step 1's
      # compile), and copied: the step donates the state, which must not delete the caller's arrays
      self.state, self.reference = jax.device_put((state, reference), jax.devices()[0], may_alias=False)
      self._step = jax.jit(step, donate_argnums=(0,), static_argnums=(4,))
    else:
      self._step, state_shardings, reference_shardings = _jit_step(step, state, reference, mesh, rules)
      self.state = jax.device_put(state, state_shardings)
      self.reference = None if reference is None else jax.device_put(reference, reference_shardings)
      self._batch_sharding = sharding.batch_sharding(mesh, rules)

  @property
  def actor(self):
    return nnx.merge(self.graphdef, self.state)[0]

  @property
  def critic(self):
    return nnx.merge(self.graphdef, self.state)[1]

  def critic_step(self, batch: TrajectoryBatch, *, process_local: bool = False) -> dict:
    """One update of the critic alone on `batch` (the actor and its optimizer stay as they are)."""
    return self.train_step(batch, process_local=process_local, update_actor=False)

  def train_step(self, batch: TrajectoryBatch, *, process_local: bool = False, update_actor: bool = True
                 ) -> dict:
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
    self.state, metrics = self._step(self.state, batch, step_rng, self.reference, update_actor)
    return metrics
