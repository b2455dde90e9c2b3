"""Checks of every request a server accepts, before anything reaches JetStream's threads.

A value the engine cannot represent would kill a prefill thread (a huge `top_k`), return non-finite
log-probs (a temperature of 1e-30) or be silently reinterpreted (JSON `true` as 1). Each check raises
`RequestError` with one line naming the field, the value and what is allowed; the server answers it
with INVALID_ARGUMENT and keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3   # logits / τ stays far inside float32; greedy is top_k = 1
SEED_LIMIT = 2**32
GENERATE_FIELDS = ("token_ids", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "seed")


class RequestError(ValueError):
  """A request that must be refused with INVALID_ARGUMENT."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one server's engine can represent."""
  vocab_size: int
  max_prefill_length: int
  max_length: int


class Malformed:
  """What the deserializer returns for a body that is not JSON, so the handler can refuse it."""

  def __init__(self, reason: str):
    self.reason = reason


def _reject_constant(name: str):
  raise ValueError(f"{name} is not a JSON number")


def parse_json(data: bytes):
  """The gRPC deserializer of the JSON service: never raises (that would answer UNKNOWN)."""
  try:
    return json.loads(data.decode("utf-8") or "{}", parse_constant=_reject_constant)
  except UnicodeDecodeError as err:
    return Malformed(f"the request body is not UTF-8 ({err.reason} at byte {err.start})")
  except (ValueError, RecursionError) as err:
    return Malformed(f"the request body is not JSON: {err}")


def json_object(body, method: str, allowed: tuple[str, ...]) -> dict:
  if isinstance(body, Malformed):
    raise RequestError(f"{method}: {body.reason}")
  if not isinstance(body, dict):
    raise RequestError(f"{method}: the request body must be a JSON object; got {type(body).__name__}")
  unknown = sorted(set(body) - set(allowed))
  if unknown:
    raise RequestError(f"{method}: unknown field(s) {unknown}; allowed: {list(allowed)}")
  return body


def _is_integer(value) -> bool:
  return isinstance(value, int | np.integer) and not isinstance(value, bool)


def integer(value, name: str, low: int, high: int) -> int:
  """An integer in [low, high] (JSON `true` is not one)."""
  if not _is_integer(value) or not low <= value <= high:
    raise RequestError(f"{name} must be an integer in [{low}, {high}]; got {value!r}")
  return int(value)


def number(value, name: str, low: float, high: float, *, low_open: bool = False) -> float:
  """A finite number in [low, high] (or (low, high] with low_open)."""
  ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
  if not ok or value > high or value < low or (low_open and value == low):
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    raise RequestError(f"{name} must be a finite number in {interval}; got {value!r}")
  return float(value)


def token_ids(value, name: str, vocab_size: int) -> list[int]:
  if not isinstance(value, list | tuple | np.ndarray) or len(value) == 0:
    raise RequestError(f"{name} must be a non-empty list of token ids; got {type(value).__name__}")
  if not all(_is_integer(t) for t in value):
    raise RequestError(f"{name} must be integers; got {next(t for t in value if not _is_integer(t))!r}")
  bad = [int(t) for t in value if not 0 <= t < vocab_size]
  if bad:
    raise RequestError(f"{name}: unknown token ids {bad[:5]}: the vocabulary has ids 0..{vocab_size - 1}")
  return [int(t) for t in value]


def generation_length(limits: Limits, prompt_length: int, max_tokens) -> int:
  """max_tokens, checked against the prefill bucket and the server's max_length."""
  if prompt_length > limits.max_prefill_length:
    raise RequestError(f"prompt of {prompt_length} tokens is longer than the prefill bucket "
                       f"({limits.max_prefill_length})")
  room = limits.max_length - prompt_length
  if not _is_integer(max_tokens) or not 1 <= max_tokens <= room:
    raise RequestError(f"max_tokens must be an integer in [1, {room}] (max_length {limits.max_length} − "
                       f"prompt {prompt_length}); got {max_tokens!r}")
  return int(max_tokens)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
  token_ids: list[int]
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int
  stop_sequences: tuple[tuple[int, ...], ...]
  seed: int | None


def generate_request(body, limits: Limits) -> GenerateRequest:
  """The `Generate` request's fields, each within what the engine represents."""
  body = json_object(body, "Generate", GENERATE_FIELDS)
  if "token_ids" not in body or "max_tokens" not in body:
    raise RequestError("Generate: token_ids and max_tokens are required")
  prompt = token_ids(body["token_ids"], "token_ids", limits.vocab_size)
  stops = body.get("stop_sequences", [])
  if not isinstance(stops, list) or len(stops) > limits.vocab_size:
    raise RequestError(f"stop_sequences must be a list of at most {limits.vocab_size} (the vocabulary's size) "
                       f"token-id lists")
  if any(isinstance(s, list) and len(s) > limits.max_length for s in stops):
    raise RequestError(f"stop_sequences: each may have at most max_length ({limits.max_length}) tokens")
  seed = body.get("seed")
  return GenerateRequest(
      token_ids=prompt, max_tokens=generation_length(limits, len(prompt), body["max_tokens"]),
      temperature=number(body.get("temperature", 1.0), "temperature", MIN_TEMPERATURE, MAX_TEMPERATURE),
      top_p=number(body.get("top_p", 1.0), "top_p", 0.0, 1.0, low_open=True),
      top_k=integer(body.get("top_k", 0), "top_k", 0, limits.vocab_size),
      stop_sequences=tuple(tuple(token_ids(s, f"stop_sequences[{i}]", limits.vocab_size))
                           for i, s in enumerate(stops)),
      seed=None if seed is None else integer(seed, "seed", 0, SEED_LIMIT - 1))


def update_weights_request(body) -> tuple[str, int, bool]:
  """(path, version, reset): `reset` starts a new sequence of versions (a new run on these servers)."""
  body = json_object(body, "UpdateWeights", ("path", "version", "reset"))
  path = body.get("path")
  if not isinstance(path, str) or not path:
    raise RequestError(f"UpdateWeights: path must be a directory path (string); got {path!r}")
  reset = body.get("reset", False)
  if not isinstance(reset, bool):
    raise RequestError(f"UpdateWeights: reset must be true or false; got {reset!r}")
  return path, integer(body.get("version"), "version", 0, 2**62), reset
