import numpy as np
from flax import nnx

from copc_jax.envs import math_tool, synthetic_tasks
from copc_jax.models import tiny
from copc_jax.models.decoder import Decoder
from copc_jax.train.setup import WarmStartConfig
from copc_jax.train.warm_start import WarmStart, encode_demonstrations


def test_loss_mask_covers_policy_tokens_only():
  tokenizer = tiny.make_tokenizer()
  prompt, response = "Q: 2*3?\n", "<code>print(2*3)</code>\n<output>\n6\n</output>\n<answer>6</answer>"
  batch = encode_demonstrations(tokenizer, [prompt], [response], length=96, bos_id=1,
                                tool_output=("<output>", "</output>"))
  ids = batch.tokens[0][batch.attention_mask[0]]
  trained = tokenizer.decode(ids[batch.loss_mask[0][: len(ids)]])
  assert trained == "<code>print(2*3)</code>\n\n<answer>6</answer><eos>"
  assert not batch.loss_mask[0, : len(prompt) + 1].any()


def test_warm_start_teaches_the_tool_format():
  tokenizer = tiny.make_tokenizer()
  train, _ = synthetic_tasks.arithmetic_splits(seed=0, train=64, eval=1)
  prompts = [math_tool.format_prompt(p["question"])[-24:] for p in train]   # short prompts for speed
  responses = [synthetic_tasks.arithmetic_demonstration(p) for p in train]
  actor = Decoder(tiny.tiny_config("qwen2", vocab_size=len(tokenizer)), rngs=nnx.Rngs(0))
  warm = WarmStart(actor)
  batches = [encode_demonstrations(tokenizer, prompts[i:i + 16], responses[i:i + 16], length=128, bos_id=1)
             for i in range(0, 64, 16)]
  losses = [warm.step(batches[k % 4]) for k in range(60)]
  assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])


def test_warm_start_is_deterministic_bit_for_bit(tmp_path):
  from copc_jax.envs.tasks import TaskConfig, make_task
  from copc_jax.models import hf_io
  from copc_jax.train import warm_start

  task = make_task(TaskConfig(name="tool_arithmetic", train_size=32, eval_size=4, system_prompt=False), seed=3)
  tiny.make_tiny_checkpoint(str(tmp_path / "base"), seed=3)
  config = WarmStartConfig(steps=12, batch_size=8, warmup_steps=2)
  paths = [warm_start.prepare(task, str(tmp_path / "base"), str(tmp_path / name), config, seed=3, log=print)
           for name in ("a", "b")]
  first, second = (hf_io.read_safetensors(p) for p in paths)
  assert first.keys() == second.keys()
  for name in first:
    assert np.array_equal(np.asarray(first[name]), np.asarray(second[name])), name
  base = hf_io.read_safetensors(str(tmp_path / "base"))
  assert any(not np.array_equal(np.asarray(base[n]), np.asarray(first[n])) for n in first)   # it trained
