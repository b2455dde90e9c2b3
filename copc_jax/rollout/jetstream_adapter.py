"""Everything JetStream-specific, in one place: google-jetstream 0.2.2 made to run on current JAX, the
`Engine` that serves `DecodeEngine` through it, and the driver and orchestrator changes the RL service needs.

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

A request's sampling options travel with it: the driver hands them to the engine's `prefill` inside
the padded prompt (`SampledPrompt`), so nothing is passed around the request.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import sys
import types

import grpc
import jax
import numpy as np

from copc_jax.rollout import requests
from copc_jax.rollout.engine import COLUMNS, LOGPROB_COLUMN, VERSION_COLUMN, DecodeEngine, SamplingOptions

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


engine_api, orchestrator, token_utils, jetstream_pb2, jetstream_pb2_grpc = install()
from jetstream.core.utils import async_multifuture  # noqa: E402, F401 - for channel.py, after install()
from jetstream.engine import tokenizer_api, tokenizer_pb2  # noqa: E402


class SlotStops:
  """Stop sequences of the request in each slot, and the tokens it generated so far.

  Written by the generate thread at insert, read by the detokenize thread, which
  only sees a slot's results after its insert (JetStream orders both on one queue).
  """

  def __init__(self, slots: int):
    self.sequences = [()] * slots
    self.history: list[list[int]] = [[] for _ in range(slots)]

  def start(self, slot: int, sequences) -> None:
    self.sequences[slot], self.history[slot] = tuple(sequences), []

  def push(self, slot: int, token: int) -> bool:
    """Record a token; True if it completes one of the slot's stop sequences."""
    history = self.history[slot]
    history.append(token)
    return any(len(s) <= len(history) and tuple(history[-len(s):]) == s for s in self.sequences[slot])


class IdTokenizer(tokenizer_api.Tokenizer):
  """JetStream tokenizer over a Hugging Face tokenizer; the stop token is EOS only."""

  def __init__(self, hf_tokenizer, eos_id: int, pad_id: int, bos_id: int, slot_stops: SlotStops):
    self._hf, self._eos, self._pad, self._bos = hf_tokenizer, eos_id, pad_id, bos_id
    self.slot_stops = slot_stops

  def encode(self, s, **kwargs):
    ids = np.asarray(self._hf(s)["input_ids"] if self._hf is not None else [], np.int32)
    return token_utils.pad_tokens(ids, self._bos, self._pad, is_bos=kwargs.get("is_bos", True),
                                  max_prefill_length=kwargs.get("max_prefill_length"),
                                  jax_padding=kwargs.get("jax_padding", True))

  def token_count(self, text: str) -> int:
    """Tokens of `text` without BOS (0 without a tokenizer)."""
    return len(self._hf(text)["input_ids"]) if self._hf is not None else 0

  def decode(self, token_ids, **kwargs):
    return self._hf.decode(list(token_ids)) if self._hf is not None else ""

  @property
  def pad_id(self):
    return self._pad

  @property
  def eos_id(self):
    return self._eos

  @property
  def bos_id(self):
    return self._bos

  @property
  def stop_tokens(self):
    return {self._eos}



@dataclasses.dataclass(frozen=True)
class SampledPrompt:
  """A padded prompt with its request's sampling options: what the driver hands the engine's prefill."""

  tokens: np.ndarray
  options: SamplingOptions | None = None


class CopcEngine(DecodeEngine, engine_api.Engine):
  """`DecodeEngine` behind JetStream's `Engine` API (0.2.2)."""

  def __init__(self, model, *, max_concurrent_decodes: int = 4, tokenizer=None, **engine_options):
    """`engine_options`: `DecodeEngine`'s. A slot that finishes inside a `decode_steps` call has its extra
    tokens dropped by the result processing, and a new request waits at most that many steps."""
    super().__init__(model, slots=max_concurrent_decodes, **engine_options)
    self._tokenizer = tokenizer
    self.slot_stops = SlotStops(max_concurrent_decodes)

  def load_params(self, *args, **kwargs):
    return self.store

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
    if existing_prefix is not None:
      raise NotImplementedError("prefix continuation is not supported")
    prompt = padded_tokens if isinstance(padded_tokens, SampledPrompt) else SampledPrompt(padded_tokens)
    return self.prefill_prompt(params.get(), prompt.tokens, true_length, prompt.options)

  def insert(self, prefix, decode_state, slot):
    self.slot_stops.start(slot, prefix.stop_sequences)
    return self.insert_prefix(prefix, decode_state, slot)

  def generate(self, params, decode_state):
    state, data = self.generate_step(decode_state)
    return state, engine_api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2),
                                          length_idx=(2, 3), samples_per_slot=1)

  def get_prefix_destination_sharding(self):
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

  def get_tokenizer(self):
    return tokenizer_pb2.TokenizerParameters(path="copc_jax", extra_ids=0)

  def build_tokenizer(self, metadata):
    eos = self.config.eos_token_id if self.config.eos_token_id is not None else 0
    bos = self.config.bos_token_id if self.config.bos_token_id is not None else eos
    pad = getattr(self._tokenizer, "pad_token_id", None)
    return IdTokenizer(self._tokenizer, eos_id=eos, pad_id=pad if pad is not None else eos, bos_id=bos,
                       slot_stops=self.slot_stops)

  @property
  def max_concurrent_decodes(self):
    return self.slots

  @property
  def samples_per_slot(self):
    return 1

  @property
  def colocated_cpus(self):
    return None


class RLActiveRequest(orchestrator.ActiveRequest):
  """JetStream's request with the sampling options of one RL generation."""

  def __init__(self, *args, sampling: SamplingOptions, **kwargs):
    super().__init__(*args, **kwargs)
    self.sampling = sampling


# JetStream 0.2.2's generate loop asserts this after its insert pass; a race can make it false.
GENERATE_RACE = "At this point we must have some requests inserted into the slots."


class CopcDriver(orchestrator.Driver):
  """JetStream's Driver; hands each request's sampling options to the engine's prefill, survives
  the generate loop's race (`_generate_thread`), and bounds how far that loop runs ahead."""

  def __init__(self, *args, calls_ahead: int = 2, **kwargs):
    """`calls_ahead`: generate calls the loop may have waiting for the detokenize thread (JetStream
    0.2.2: 8). A slot is freed only when the detokenizer sees its request finish, so every call
    ahead decodes a finished slot for nothing; 2 keeps the device fed while the host catches up."""
    if calls_ahead < 1:
      raise ValueError(f"calls_ahead must be >= 1; got {calls_ahead}")
    super().__init__(*args, **kwargs)
    for backlog in self._detokenize_backlogs:     # before any request: nothing is queued yet
      with backlog.mutex:
        backlog.maxsize = calls_ahead

  def occupancy(self) -> dict:
    """Slots decoding a request now, requests waiting for a prefill, and whether the driver runs."""
    free = sum(q.qsize() for q in self._generate_slots)
    return {"slots_in_use": sum(e.max_concurrent_decodes for e in self._generate_engines) - free,
            "queue_length": self._prefill_backlog.qsize(), "live": bool(self.live)}

  def _generate_thread(self, idx: int):
    """JetStream's generate loop, started over where 0.2.2 trips on its own race.

    The loop notes how many slots are free, takes one, finds no new request and puts the slot back;
    if the detokenize thread frees the last busy slots in between, the loop's assertion that some
    slot is busy fails, and JetStream SIGKILLs the whole server. At that moment every slot is free:
    no request is in flight, so the loop starts over with a fresh decode state and loses nothing.
    """
    while True:
      try:
        return super()._generate_thread(idx)
      except AssertionError as err:
        if str(err) != GENERATE_RACE or not self.live:
          raise
        logging.info("generate loop %d: every slot was freed during its insert pass; starting over", idx)

  def _process_prefill_content(self, request, tokenizer, is_bos, max_prefill_length):
    content = request.prefill_content
    if not isinstance(content, str):
      request.prefill_content = np.asarray(content, np.int32)   # 0.2.2 needs an array without BOS
    padded, true_length = super()._process_prefill_content(request, tokenizer, is_bos, max_prefill_length)
    return SampledPrompt(padded, getattr(request, "sampling", None)), true_length


def limits_of(engine: CopcEngine) -> requests.Limits:
  return requests.Limits(vocab_size=engine.config.vocab_size, max_prefill_length=engine.max_prefill_length,
                         max_length=engine.max_length)


class ValidatingOrchestrator(orchestrator.LLMOrchestrator):
  """The stock service, refusing requests that would crash JetStream's threads. Text prompts are
  tokenized as the driver will (BOS added unless a session cache is given) and checked the same."""

  def __init__(self, driver, engine: CopcEngine):
    super().__init__(driver)
    self._engine = engine
    self._tokenizer = engine.build_tokenizer(None)

  def _check(self, request) -> None:
    limits, bos = limits_of(self._engine), int(not request.session_cache)
    if request.WhichOneof("content") == "token_content":
      prompt = requests.token_ids(list(request.token_content.token_ids), "token_content.token_ids",
                                  limits.vocab_size)
      length = len(prompt) + bos
    elif request.WhichOneof("content") == "text_content":
      text = request.text_content.text
      if not text:
        raise requests.RequestError("text_content.text must be a non-empty string")
      length = self._tokenizer.token_count(text) + bos
      if length == bos:
        raise requests.RequestError("text_content.text tokenizes to no tokens (the server has no tokenizer)")
    else:
      raise requests.RequestError("Decode: the request has neither token_content nor text_content")
    requests.generation_length(limits, length, request.max_tokens)

  async def Decode(self, request, context=None):  # noqa: N802 - gRPC method name
    try:
      self._check(request)
    except requests.RequestError as err:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Decode: {err}")
    async for response in super().Decode(request, context):
      yield response
