"""One of two learner processes joined through `jax.distributed` on localhost (see test_multihost.py).

Usage: python multihost_worker.py PROCESS_ID COORDINATOR_PORT
Prints one line "RESULT {json}" with the step's metrics and a checksum of the updated actor.
"""

import json
import os
import sys

if __name__ == "__main__":   # set before JAX starts; importing this module (the test) changes nothing
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402


def run_step():
  import jax.numpy as jnp
  from flax import nnx

  from copc_jax import presets, sharding
  from copc_jax.models import tiny
  from copc_jax.models.decoder import Decoder, ValueModel
  from copc_jax.train import Learner, LearnerConfig, OptimizerConfig
  from copc_jax.train.fake_data import random_batch

  config = tiny.tiny_config("qwen2")
  actor = Decoder(config, rngs=nnx.Rngs(0))
  critic = ValueModel.from_policy(actor, rngs=nnx.Rngs(1))
  preset = presets.get_preset("copc")
  batch = random_batch(actor, batch_size=8, prompt_length=6, response_length=14, seed=3)
  mesh = sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(2, 2, 2)))
  learner = Learner(actor, critic, LearnerConfig(
      estimator=preset.estimator, actor=preset.actor, actor_optimizer=OptimizerConfig(learning_rate=1e-3),
      critic_optimizer=OptimizerConfig(learning_rate=1e-3)), mesh=mesh)
  metrics = learner.train_step(batch)
  params = nnx.state(learner.actor, nnx.Param)
  checksum = jax.jit(lambda p: sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(p)))(params)
  return {"actor_loss": float(metrics["actor_loss"]), "value_loss": float(metrics["value_loss"]),
          "actor_grad_norm": float(metrics["actor_grad_norm"]), "param_checksum": float(checksum),
          "process_count": jax.process_count(), "device_count": jax.device_count()}


if __name__ == "__main__":
  process_id, port = int(sys.argv[1]), int(sys.argv[2])
  try:   # multi-process collectives on CPU
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except AttributeError:
    pass
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  print("RESULT " + json.dumps(run_step()), flush=True)
