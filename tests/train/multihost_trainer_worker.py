"""One of two trainer processes joined through `jax.distributed` on localhost (see test_multihost.py).

Usage: python multihost_trainer_worker.py PROCESS_ID COORDINATOR_PORT WORKDIR STEPS MODE [FAIL_PROCESS_AFTER]
Each process has its own scripted stand-in pool (as each would have its own local servers).
Prints "RESULT {json}" with the versions its pool received. With FAIL_PROCESS_AFTER = "P:N", the
pool of process P raises after N generations; that process prints "STOPPED {message}" and exits 3.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

if __name__ == "__main__":
  process_id, port, workdir, steps, mode, *fail = sys.argv[1:]
  try:   # multi-process collectives on CPU
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except AttributeError:
    pass
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id))

  from test_trainer import make_config, scripted_pool_factory

  from copc_jax.train import trainer

  pools = []
  config = make_config(trainer=dict(mode=mode, steps=int(steps), checkpoint_every=1, eval_every=2,
                                    max_staleness=1))
  factory = scripted_pool_factory(pools)
  if fail and fail[0].split(":")[0] == process_id:
    def factory(evaluation=False, after=int(fail[0].split(":")[1])):
      from test_trainer import FailingPool

      from copc_jax.models import tiny
      pools.append(FailingPool(len(tiny.make_tokenizer()), fail_after=after))
      return pools[-1]
  try:
    summary = trainer.Trainer(trainer.build(config, workdir, backend_factory=factory)).run()
  except trainer.TrainingError as err:
    print("STOPPED " + str(err).replace("\n", " "), flush=True)
    os._exit(3)        # the other process waits in a collective; do not wait for it at exit
  print("RESULT " + json.dumps({"pushes": pools[0].pushes, "steps": summary["steps"],
                                "process_count": jax.process_count()}), flush=True)
