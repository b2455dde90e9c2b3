"""Qwen2.5 (3B or 7B) on search (Search-R1 setup: NQ + HotpotQA, 2018 Wikipedia, E5/BM25 retriever).

    python -m copc_jax.main --distributed --config=configs/qwen2_5_search.py:7b --workdir=$WORKDIR \
        --config.rollout.addresses="('10.0.0.2:9000',)" --config.task.retriever_url=http://10.0.0.9:8000

The retriever is a separate service (`python -m copc_jax.envs.search --index=DIR`, or any server
with Search-R1's POST /retrieve API); exact match is the reward. The data: `python -m copc_jax.data.prepare
--source=search_r1 --input=<Search-R1's train.parquet> --output=/mnt/data/nq_hotpotqa_train.jsonl` (and
its test split).
"""

from configs import common

SIZES = {
    "3b": ("/mnt/models/Qwen2.5-3B-Instruct", (1, -1, 1)),
    "7b": ("/mnt/models/Qwen2.5-7B-Instruct", (1, -1, 2)),     # FSDP 8 x tensor 2 (see the math config)
}


# The slices each size runs on (see configs/qwen2_5_math.py), checked by experiments/fit_tpu.py.
HARDWARE = {
    "3b": dict(learner="v5p:2x2x4", server="v5e:2x4", server_chips_per_host=(2, 4, 1)),
    "7b": dict(learner="v5p:2x2x4", server="v5e:2x4", server_chips_per_host=(2, 4, 1)),
}
SERVER_TOPOLOGY = {"3b": (4, 2), "7b": (2, 4)}     # (data groups, tensor) of each server's 8 chips


def get_config(arg="7b"):
  size, *preset = (arg or "7b").split(",")
  if size not in SIZES:
    raise ValueError(f"configs/qwen2_5_search.py:<size>[,<preset>]: size must be one of {sorted(SIZES)}; "
                     f"got {size!r}")
  checkpoint, mesh = SIZES[size]
  config = common.train_config(preset[0] if preset else "copc")
  config.model.checkpoint = checkpoint
  config.model.update(dict(scan_layers=True, remat="full"))    # bf16 compute and splash attention on TPU
  config.sharding.mesh_shape = mesh
  config.task.update(dict(
      name="search", system_prompt=True, chat_template=True, train_path="/mnt/data/nq_hotpotqa_train.jsonl",
      eval_path="/mnt/data/nq_hotpotqa_test.jsonl", question_field="question",
      answer_field="answer", retriever_url="http://127.0.0.1:8000", topk=3, reward_metric="em",
      eval_size=512))
  config.rollout.update(dict(
      slots=128, max_prefill_length=4096, max_length=8192, max_in_flight=128, max_turns=4,
      max_tokens_per_turn=512, ready_timeout_s=1800.0, server_dtype="bfloat16",
      server_data_parallelism=SERVER_TOPOLOGY[size][0], server_tensor_parallelism=SERVER_TOPOLOGY[size][1]))
  config.trainer.update(dict(
      mode=common.mode_for(config.preset),
      steps=1000, batch_size=512, num_minibatches=4, max_staleness=4, eval_every=50,
      checkpoint_every=10, actor_learning_rate=1e-6, critic_learning_rate=1e-5, warmup_steps=10,
      logits_chunk=512, forward_microbatches=8, pad_to_multiple=1024))
  if size == "7b":      # 16 rows of 8k tokens per fsdp shard in a minibatch: 4 at a time (see the math config)
    config.trainer.gradient_accumulation = 4
  return config
