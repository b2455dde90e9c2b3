"""Qwen2.5 (1.5B or 7B) on math with a Python tool, asynchronous COPC, on a TPU slice + JetStream servers.

    python -m copc_jax.main --distributed --config=configs/qwen2_5_math.py:7b --workdir=$WORKDIR \
        --config.rollout.addresses="('10.0.0.2:9000','10.0.0.3:9000')"

(tpu_scripts/start_learner.sh runs exactly this on every host of the slice.) The data are the
releases turned into the task's rows: `python -m copc_jax.data.prepare --source=dapo_math
--input=dapo-math-17k.parquet --output=/mnt/data/dapo_math_17k.jsonl`, and `--source=aime_2024` for the
evaluation set. The checkpoint, the data
and the workdir are paths on the hosts; the workdir must be shared with the servers, which load each
pushed version from it. Settings follow the anchors (DAPO-Math-17k for training, AIME-24 for eval,
16k-token contexts, γ = λ = 1, batch 512 in 4 minibatches).
"""

from configs import common

SIZES = {
    # size: (checkpoint, mesh (data, fsdp, tensor), actor lr, critic lr)
    "1.5b": ("/mnt/models/Qwen2.5-1.5B-Instruct", (1, -1, 1), 1e-6, 5e-6),
    # 7B: FSDP 8 x tensor 2 on the 16 chips (tensor 4 replicates each fsdp shard's 16k-token
    # activations 4 times: 105 GiB of saved layer inputs per chip; experiments/fit_tpu.py)
    "7b": ("/mnt/models/Qwen2.5-7B-Instruct", (1, -1, 2), 1e-6, 5e-6),
}


# The slices each size runs on (tpu_scripts/: LEARNER_TYPE, SERVER_TYPE), checked by experiments/fit_tpu.py
# from the compiler's per-chip plan: learner v5p-32 (16 chips), servers v5litepod-8 (8 chips, one host).
HARDWARE = {
    "1.5b": dict(learner="v5p:2x2x4", server="v5e:2x4", server_chips_per_host=(2, 4, 1)),
    "7b": dict(learner="v5p:2x2x4", server="v5e:2x4", server_chips_per_host=(2, 4, 1)),
}
# Each server's 8 chips as (data groups, tensor): the KV cache's slots over `data`, its KV heads and the
# model over `tensor` (7B's 4 KV heads divide 4, not 8), bfloat16 weights and cache.
SERVER_TOPOLOGY = {"1.5b": (4, 2), "7b": (2, 4)}


def get_config(arg="7b"):
  size, *preset = (arg or "7b").split(",")
  if size not in SIZES:
    raise ValueError(f"configs/qwen2_5_math.py:<size>[,<preset>]: size must be one of {sorted(SIZES)}; "
                     f"got {size!r}")
  checkpoint, mesh, actor_lr, critic_lr = SIZES[size]
  config = common.train_config(preset[0] if preset else "copc")
  config.model.checkpoint = checkpoint
  config.model.update(dict(scan_layers=True, remat="full"))    # bf16 compute and splash attention on TPU
  config.sharding.mesh_shape = mesh
  config.task.update(dict(
      name="math", system_prompt=True, chat_template=True, train_path="/mnt/data/dapo_math_17k.jsonl",
      eval_path="/mnt/data/aime_2024.jsonl", question_field="question", answer_field="answer",
      eval_size=30, code_timeout_s=10.0, code_error_penalty=0.0))
  config.rollout.update(dict(
      addresses=(), num_servers=1, slots=64, max_prefill_length=4096, max_length=16384, max_in_flight=64,
      max_turns=8, max_tokens_per_turn=4096, temperature=1.0, ready_timeout_s=1800.0, server_dtype="bfloat16",
      server_data_parallelism=SERVER_TOPOLOGY[size][0], server_tensor_parallelism=SERVER_TOPOLOGY[size][1]))
  config.trainer.update(dict(
      mode=common.mode_for(config.preset),
      steps=500, batch_size=512, num_minibatches=4, max_staleness=4, sync_every=1,
      eval_every=25, checkpoint_every=10, actor_learning_rate=actor_lr, critic_learning_rate=critic_lr,
      warmup_steps=10, logits_chunk=512, forward_microbatches=8, pad_to_multiple=1024))
  if size == "7b":
    # A minibatch of 128 rows x 16k tokens puts 16 rows on each fsdp shard: their saved layer inputs and
    # MLP activations need 139 GiB per v5p chip even at 8 rows (experiments/fit_tpu.py). Each
    # minibatch's gradient summed over 8 row groups (2 rows per shard at a time): 38 GiB.
    config.trainer.gradient_accumulation = 8
  config.warm_start.steps = 0                 # instruct models already follow the tool format
  return config
