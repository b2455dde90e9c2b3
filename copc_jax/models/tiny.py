"""Tiny random checkpoints and a tiny tokenizer, built locally (no download).

    python -m copc_jax.models.tiny --out=/tmp/tiny-qwen2 --arch=qwen2

The tokenizer is a word-level one over digits, letters, punctuation and the
special tokens of the tasks, built with `tokenizers` and saved in Hugging Face
format, so `AutoTokenizer.from_pretrained` loads it.
"""

from __future__ import annotations

import argparse
import string

import jax.numpy as jnp
from flax import nnx

from copc_jax.models.config import ModelConfig
from copc_jax.models.decoder import Decoder
from copc_jax.models.hf_io import save_pretrained

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TASK_TOKENS = ["<code>", "</code>", "<output>", "</output>", "<answer>", "</answer>",
               "<search>", "</search>", "<information>", "</information>"]


def tiny_vocabulary() -> list[str]:
  symbols = list(string.digits + string.ascii_letters + string.punctuation) + [" ", "\n"]
  return SPECIAL_TOKENS + TASK_TOKENS + symbols


def make_tokenizer(extra_tokens: tuple[str, ...] = ()):
  """A character-level tokenizer with whole-token task tags, as a `PreTrainedTokenizerFast`."""
  import tokenizers
  import transformers
  from tokenizers import decoders, models, pre_tokenizers

  vocab = {token: i for i, token in enumerate(tiny_vocabulary() + list(extra_tokens))}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIAL_TOKENS])
  tok.add_tokens([tokenizers.AddedToken(t, special=False) for t in TASK_TOKENS])
  tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
  tok.decoder = decoders.Fuse()   # characters join back without spaces
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def tiny_config(arch: str = "qwen2", vocab_size: int | None = None, **overrides) -> ModelConfig:
  vocab_size = vocab_size or len(tiny_vocabulary())
  base = dict(model_type=arch, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
              tie_word_embeddings=arch != "llama", qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
              bos_token_id=1, eos_token_id=2, max_position_embeddings=2048)
  base.update(overrides)
  return ModelConfig(**base)


def make_tiny_checkpoint(path: str, arch: str = "qwen2", seed: int = 0, **overrides) -> ModelConfig:
  tokenizer = make_tokenizer()
  config = tiny_config(arch, vocab_size=len(tokenizer), **overrides)
  model = Decoder(config, rngs=nnx.Rngs(seed), dtype=jnp.float32)
  save_pretrained(model, path, tokenizer=tokenizer)
  return config


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3", "llama"])
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  config = make_tiny_checkpoint(args.out, args.arch, args.seed)
  print(f"wrote a tiny {args.arch} checkpoint ({config.num_layers} layers, vocab {config.vocab_size}) "
        f"to {args.out}")


if __name__ == "__main__":
  main()
