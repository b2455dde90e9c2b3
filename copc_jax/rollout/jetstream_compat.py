"""Everything copc_jax needs to run google-jetstream 0.2.2 on current JAX, in one place.

`install()` (idempotent) must run before any other `jetstream` import:

1. `jax.tree_map` was removed from JAX; 0.2.2's orchestrator calls it on every
   insert (and a failing JetStream thread SIGKILLs the process): alias it.
2. `jetstream.engine.token_utils` imports `seqio` (and through it TensorFlow)
   for vocabulary classes we never use: register a stub `seqio.vocabularies`
   whose SentencePiece class refuses to be built.
3. 0.2.2's orchestrator sets the root logger to DEBUG with a stdout handler at
   import: undo it.
4. `token_utils.process_result_tokens` drops every column of `ResultTokens.data`
   beyond the token/valid/length ranges, and drops the stop token: replace it
   with `process_result_tokens` below, which also returns each token's
   log-probability and weights version, the stop token, and a finish reason.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import sys
import types

import jax
import numpy as np

# Extra int32 columns that copc_jax's engine packs after token | valid | length.
LOGPROB_COLUMN = 3   # float32 log-probability, bit-cast to int32
VERSION_COLUMN = 4   # weights version that produced the token
COLUMNS = 5          # per decode step: token, valid, length, log-prob bits, version
FINISH_STOP, FINISH_LENGTH, FINISH_STOP_SEQUENCE = "stop", "length", "stop_sequence"

_installed = False


def _install_seqio_stub() -> None:
  if "seqio" in sys.modules:
    return

  class Vocabulary(abc.ABC):  # noqa: B024 - only subclassed by JetStream's test vocabulary
    """Stand-in base class; JetStream's TestVocab subclasses it."""

  class SentencePieceVocabulary(Vocabulary):
    def __init__(self, *args, **kwargs):
      raise ImportError("SentencePiece vocabularies need seqio/TensorFlow, which copc_jax does not "
                        "install; copc_jax engines build their own tokenizer")

  seqio = types.ModuleType("seqio")
  vocabularies = types.ModuleType("seqio.vocabularies")
  vocabularies.Vocabulary = Vocabulary
  vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
  seqio.vocabularies = vocabularies
  sys.modules["seqio"] = seqio
  sys.modules["seqio.vocabularies"] = vocabularies


@dataclasses.dataclass
class RLReturnSample:
  """What one generate step returns for one sample: JetStream's `ReturnSample` fields and ours."""

  text: list[str]
  token_ids: list[int]
  logprobs: list[float]
  versions: list[int]
  finish_reason: str | None = None


def process_result_tokens(tokenizer, slot: int, slot_max_length: int, result_tokens,
                          complete: np.ndarray, is_client_side_tokenization: bool = False,
                          debug: bool = False):
  """Drop-in for 0.2.2's `token_utils.process_result_tokens` that keeps our columns.

  Unlike the stock function, a stop token is returned (with its log-probability)
  before the sample completes with finish reason "stop"; the last token of one of
  the request's stop sequences (a tool call) ends it with "stop_sequence"; reaching
  `slot_max_length` tokens ends it with "length". A row holds one or more decode
  steps (`COLUMNS` columns each, `CopcEngine.decode_steps`); the tokens after the
  one that completes a sample are dropped.
  """
  del debug
  rows = result_tokens.data[slot * result_tokens.samples_per_slot:
                            (slot + 1) * result_tokens.samples_per_slot]
  slot_stops = getattr(tokenizer, "slot_stops", None)
  samples = []
  complete = complete.copy()
  for i in range(len(rows)):
    sample = RLReturnSample(text=[], token_ids=[], logprobs=[], versions=[])
    for step in range(rows.shape[1] // COLUMNS):
      if complete[i]:
        break
      columns = rows[i, step * COLUMNS:(step + 1) * COLUMNS]
      if not columns[result_tokens.valid_idx[0]]:
        complete[i], sample.finish_reason = True, FINISH_STOP
        break
      token = int(columns[result_tokens.tokens_idx[0]])
      sample.token_ids.append(token)
      sample.logprobs.append(float(np.array(columns[LOGPROB_COLUMN], np.int32).view(np.float32)))
      sample.versions.append(int(columns[VERSION_COLUMN]))
      if not is_client_side_tokenization:
        sample.text.append(tokenizer.decode([token]))
      if token in tokenizer.stop_tokens:
        complete[i], sample.finish_reason = True, FINISH_STOP
      elif slot_stops is not None and slot_stops.push(slot, token):
        complete[i], sample.finish_reason = True, FINISH_STOP_SEQUENCE
      elif columns[result_tokens.length_idx[0]] >= slot_max_length:
        complete[i], sample.finish_reason = True, FINISH_LENGTH
    samples.append(sample)
  return samples, complete


def install():
  """Patch once; returns (engine_api, orchestrator, token_utils, jetstream_pb2, jetstream_pb2_grpc)."""
  global _installed
  if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map
  _install_seqio_stub()
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  from jetstream.core import orchestrator
  from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
  from jetstream.engine import engine_api, token_utils
  if not _installed:
    for handler in list(root.handlers):
      if handler not in handlers:
        root.removeHandler(handler)
    root.setLevel(level)
    token_utils.process_result_tokens = process_result_tokens
    _installed = True
  return engine_api, orchestrator, token_utils, jetstream_pb2, jetstream_pb2_grpc
