"""Supervised warm start on demonstrations, so RL starts from a policy that follows the format.

The loss is the token-mean negative log-likelihood of the response tokens the
policy would generate; prompt tokens and tool output (between the task's
`tool_output` tags, e.g. `<output>…</output>`) are context only, as they will be in RL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from copc_jax.models import hf_io
from copc_jax.sampling import token_logprobs_and_entropy
from copc_jax.train import checkpoint, multihost
from copc_jax.train.learner import OptimizerConfig
from copc_jax.train.setup import WarmStartConfig


@dataclasses.dataclass(frozen=True)
class DemonstrationBatch:
  tokens: np.ndarray          # int32 [B, T]
  attention_mask: np.ndarray  # bool [B, T]
  loss_mask: np.ndarray       # bool [B, T]: response tokens written by the policy


def encode_demonstrations(tokenizer, prompts: list[str], responses: list[str], length: int,
                          bos_id: int | None = None, tool_output: tuple[str, str] | None = None
                          ) -> DemonstrationBatch:
  """Tokenise prompt + response pairs; loss on response characters outside tool-output spans."""
  b = len(prompts)
  tokens = np.zeros((b, length), np.int32)
  attention_mask = np.zeros((b, length), bool)
  loss_mask = np.zeros((b, length), bool)
  for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
    text = prompt + response
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
    if bos_id is not None:
      ids, offsets = [bos_id] + ids, [(0, 0)] + offsets
    eos = tokenizer.eos_token_id
    ids.append(eos)
    offsets.append((len(text), len(text) + 1))   # the policy learns to stop
    if len(ids) > length:
      raise ValueError(f"demonstration {i} has {len(ids)} tokens; the batch length is {length}")
    pattern = tool_output and re.escape(tool_output[0]) + ".*?" + re.escape(tool_output[1])
    tool_spans = [m.span() for m in re.finditer(pattern, text, re.S)] if pattern else []
    for t, (start, end) in enumerate(offsets):
      in_response = start >= len(prompt) and end > start
      in_tool = any(s <= start and end <= e for s, e in tool_spans)
      loss_mask[i, t] = in_response and not in_tool
    tokens[i, :len(ids)] = ids
    attention_mask[i, :len(ids)] = True
  return DemonstrationBatch(tokens, attention_mask, loss_mask)


def sft_loss(actor, batch: DemonstrationBatch):
  logits = actor(batch.tokens, attention_mask_bt=batch.attention_mask)
  logp, _ = token_logprobs_and_entropy(logits, batch.tokens)
  mask = jnp.asarray(batch.loss_mask, jnp.float32)
  return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)


class WarmStart:
  """AdamW on `sft_loss`; `step(batch)` returns the loss before the update."""

  def __init__(self, actor, optimizer: OptimizerConfig = OptimizerConfig(learning_rate=3e-3)):
    self.actor = actor
    self.optimizer = nnx.Optimizer(actor, optimizer.make(), wrt=nnx.Param)

    @nnx.jit
    def step(actor, opt, tokens, attention_mask, loss_mask):
      batch = DemonstrationBatch(tokens, attention_mask, loss_mask)
      loss, grads = nnx.value_and_grad(sft_loss)(actor, batch)
      opt.update(actor, grads)
      return loss

    self._step = step

  def step(self, batch: DemonstrationBatch) -> float:
    return float(self._step(self.actor, self.optimizer, batch.tokens, batch.attention_mask, batch.loss_mask))



def _round_up(n: int, multiple: int = 16) -> int:
  return -(-n // multiple) * multiple


def train_on_demonstrations(actor, tokenizer, demonstrations: list[dict], config: WarmStartConfig,
                            seed: int = 0, log=None, tool_output: tuple[str, str] | None = None) -> list[float]:
  """`config.steps` SFT steps on random minibatches of {"prompt", "response"}; returns the losses."""
  lengths = [len(tokenizer.encode(d["prompt"] + d["response"], add_special_tokens=False)) + 2
             for d in demonstrations]
  encoded = encode_demonstrations(tokenizer, [d["prompt"] for d in demonstrations],
                                  [d["response"] for d in demonstrations], _round_up(max(lengths)),
                                  bos_id=tokenizer.bos_token_id, tool_output=tool_output)
  trainer = WarmStart(actor, OptimizerConfig(learning_rate=config.learning_rate,
                                             warmup_steps=config.warmup_steps))
  rng = np.random.default_rng(seed)
  batch_size = min(config.batch_size, len(demonstrations))
  losses = []
  for step in range(config.steps):
    rows = rng.choice(len(demonstrations), batch_size, replace=False)
    batch = DemonstrationBatch(encoded.tokens[rows], encoded.attention_mask[rows], encoded.loss_mask[rows])
    losses.append(trainer.step(batch))
    if log is not None and (step + 1) % max(1, config.steps // 5) == 0:
      log(f"warm start step {step + 1}/{config.steps}: loss {np.mean(losses[-20:]):.4f}")
  return losses


def prepare(task, base_checkpoint: str, directory: str, config: WarmStartConfig, *, seed: int = 0,
            log=print, tokenizer_dir: str | None = None) -> str:
  """The base model warm-started on `task`'s training demonstrations; returns its directory.
  `tokenizer_dir`: where the tokenizer is (default: the base checkpoint).

  Cached: `directory/model` (a `save_pretrained` directory with the tokenizer) and
  `directory/demonstrations.jsonl` are written once and reused, so many runs
  (a study's cells, a resumed run) share one warm start. Deterministic: the same
  task, base model, config and seed give the same weights bit for bit. With
  several processes the chief trains and the others wait for the result.
  """
  model_dir = os.path.join(directory, "model")
  if multihost.is_chief() and not os.path.exists(model_dir):
    os.makedirs(directory, exist_ok=True)
    demos_path = os.path.join(directory, "demonstrations.jsonl")
    if not os.path.exists(demos_path):
      demos = task.demonstrations(task.train)
      checkpoint.write_atomically(demos_path, lambda tmp: _write_jsonl(tmp, demos))
    with open(demos_path) as f:
      demos = [json.loads(line) for line in f]
    actor, _ = hf_io.from_pretrained(base_checkpoint, load_tokenizer=False)
    tokenizer = hf_io.load_tokenizer(tokenizer_dir or base_checkpoint, needed_for="the warm start")
    start = time.time()
    losses = train_on_demonstrations(actor, tokenizer, demos, config, seed=seed, log=log,
                                     tool_output=task.tool_output)
    log(f"warm start: {len(losses)} steps in {time.time() - start:.1f} s, final loss "
        f"{np.mean(losses[-20:]):.4f}")
    checkpoint.write_atomically(model_dir, lambda tmp: hf_io.save_pretrained(actor, tmp, tokenizer=tokenizer))
  elif multihost.is_chief():
    log(f"warm start: reusing {model_dir}")
  multihost.barrier("warm start")
  return model_dir


def _write_jsonl(path: str, rows: list[dict]) -> None:
  with open(path, "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
