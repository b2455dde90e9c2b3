"""Sections shared by the config files: the method (preset + overrides), sharding, and the trainer.

Fields left as None (placeholders) take the preset's value (copc_jax/presets.py);
anything set here or on the command line overrides it.
"""

from ml_collections import config_dict

from copc_jax import sharding

placeholder = config_dict.placeholder


def add_method_sections(config: config_dict.ConfigDict) -> None:
  config.estimator = config_dict.ConfigDict(dict(
      gamma=placeholder(float), lam=placeholder(float), rho_clip=placeholder(tuple),
      trace_clip=placeholder(tuple), advantage_form=placeholder(str),
      whiten_advantages=placeholder(bool), impl=placeholder(str)))
  config.actor = config_dict.ConfigDict(dict(
      policy_ratio=placeholder(str), behavior_weight=placeholder(str),
      weight_cap=placeholder(float), mask_range=placeholder(tuple),
      clip_eps_low=placeholder(float), clip_eps_high=placeholder(float),
      aggregation=placeholder(str), kl_coef=placeholder(float), kl_estimator=placeholder(str),
      entropy_coef=placeholder(float)))
  config.value = config_dict.ConfigDict(dict(clip=0.5, aggregation="token_mean"))
  # Mesh over (data, fsdp, tensor); -1 takes the remaining devices. Rules map logical axes
  # of the parameters to mesh axes (see copc_jax/sharding.py).
  config.sharding = config_dict.ConfigDict(dict(mesh_shape=(1, -1, 1), rules=sharding.DEFAULT_RULES))


def train_config(preset: str) -> config_dict.ConfigDict:
  """Every section of the `train` job, with the library's defaults; config files change what they need."""
  config = config_dict.ConfigDict()
  config.job = "train"
  config.preset = preset
  config.seed = 0
  add_method_sections(config)
  config.model = config_dict.ConfigDict(dict(checkpoint="tiny", tiny_arch="qwen2"))
  config.task = config_dict.ConfigDict(dict(
      name="tool_arithmetic", system_prompt=True, train_size=512, eval_size=128, demo_tool_fraction=1.0,
      train_path="", eval_path="", question_field="question", answer_field="answer", corpus_path="",
      retriever_url="", topk=3, reward_metric="em", code_timeout_s=5.0, code_error_penalty=0.0))
  config.rollout = config_dict.ConfigDict(dict(
      num_servers=2, addresses=(), slots=8, max_prefill_length=64, max_length=128, max_in_flight=8,
      max_turns=3, max_tokens_per_turn=48, temperature=1.0, top_p=1.0, top_k=0, workers=0,
      ready_timeout_s=300.0))
  config.trainer = config_dict.ConfigDict(dict(
      mode="async", steps=60, batch_size=32, max_staleness=4, sync_every=1, lag=0, eval_every=20,
      checkpoint_every=10, epochs=1, num_minibatches=1, actor_learning_rate=1e-4,
      critic_learning_rate=1e-3, max_grad_norm=1.0, warmup_steps=0, progress_bar=True))
  config.warm_start = config_dict.ConfigDict(dict(steps=0, batch_size=32, learning_rate=3e-3, warmup_steps=20))
  return config
