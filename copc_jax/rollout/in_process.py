"""Rollouts generated in the learner's own process, on its devices: no servers, no gRPC, no weight files.

    backend = InProcessBackend(actor, slots=8, max_prefill_length=64, max_length=128, mesh=learner.mesh)
    out = backend.generate(prompt_ids, 48, seed=7, stop_sequences=[end_ids])     # from any thread
    backend.push(WeightUpdate(3, nnx.state(actor, nnx.Param), "arrays"))        # or a directory by path

The same `DecodeEngine` the JetStream servers run (`engine.py`: its batched prefill body and
`decode_step`), driven by one thread of this process: the requests waiting, from any thread (the
episode workers), are prefilled together into free slots in one device call (an idle backend first
waits `admission_window_s` for a batch sent together), then one jitted `lax.while_loop` decodes every
busy slot for up to `steps_per_call` steps, stopping a slot on the device when it samples EOS, completes
one of its stop sequences or reaches its `max_tokens` (finish reasons "stop", "stop_sequence",
"length", as the servers report them). New requests join between calls. Tokens, log-probs and
version tags follow the servers' sampling contract: with a seed, token i is drawn with
fold_in(key(seed), i) from the weights' logits, so the same request gives the same tokens here and on
a server (up to float rounding: a prompt prefilled together with others is computed in a batch of
another shape, which moves its logits by about 1e-7; the servers prefill one prompt at a time).
Multi-turn tool calls happen between `generate` calls, as with the servers.

One host only (a multi-process learner has no single process to generate in: use the JetStream pool).
Sync, lag and async modes all work; in async mode the driver thread shares the devices with the
learner's step, so generation and learning take turns rather than overlap.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from copc_jax.models.decoder import Decoder
from copc_jax.rollout import requests
from copc_jax.rollout.engine import DecodeEngine, DecodeState, SamplingOptions, SlotPrompt, decode_step
from copc_jax.rollout.protocol import Generation, ServerStatus, WeightUpdate
from copc_jax.sampling import SamplingParams

MAX_STOP_SEQUENCES = 4       # per request; each of at most STOP_WINDOW tokens (fixed shapes: one compile)
STOP_WINDOW = 16
FINISH_REASONS = (None, "stop", "stop_sequence", "length")      # the device's finish codes 0..3


@struct.dataclass
class SlotControl:
  """What the device needs to stop each slot: its stop sequences right-aligned in [N, STOP_WINDOW]
  (−1 padded), the last STOP_WINDOW tokens it generated, the tokens it may still generate."""

  running: jax.Array          # [S] bool
  remaining: jax.Array        # [S] int32
  stops: jax.Array            # [S, N, W] int32
  stop_lengths: jax.Array     # [S, N] int32 (0: no sequence)
  recent: jax.Array           # [S, W] int32 (−1: nothing yet)


@struct.dataclass
class CallOutput:
  tokens: jax.Array           # [S, C]
  logprobs: jax.Array         # [S, C]
  versions: jax.Array         # [S, C]
  emitted: jax.Array          # [S] tokens written this call
  finish: jax.Array           # [S] code in FINISH_REASONS (0: still running)


def decode_until_done(model: Decoder, state: DecodeState, control: SlotControl, version, *, steps: int,
                      max_length: int, eos_id: int):
  """Up to `steps` decode steps of every slot, ending early when no slot runs. A slot stops after the
  token that is EOS ("stop"), completes a stop sequence ("stop_sequence") or is its last allowed
  ("length"), checked in that order; stopped slots keep stepping (fixed shapes) but emit nothing."""
  slots = state.lengths.shape[0]
  window = control.recent.shape[1]
  needed = jnp.arange(window)[None, None, :] >= (window - control.stop_lengths)[:, :, None]   # [S, N, W]

  def running(carry):
    i, _, control, _ = carry
    return (i < steps) & jnp.any(control.running)

  def step(carry):
    i, state, control, out = carry
    state, sampled = decode_step(model, state, version, max_length)
    emit = control.running
    recent = jnp.where(emit[:, None], jnp.concatenate([control.recent[:, 1:], sampled.tokens[:, None]], 1),
                       control.recent)
    completes = jnp.all(~needed | (recent[:, None, :] == control.stops), axis=-1) & (control.stop_lengths > 0)
    remaining = control.remaining - emit
    finish = jnp.where(sampled.tokens == eos_id, 1, jnp.where(jnp.any(completes, -1), 2,
                                                              jnp.where(remaining <= 0, 3, 0)))
    finish = jnp.where(emit, finish, 0)
    column = jnp.minimum(out.emitted, steps - 1)
    write = lambda buffer, values: buffer.at[jnp.arange(slots), column].set(
        jnp.where(emit, values, buffer[jnp.arange(slots), column]))
    out = out.replace(tokens=write(out.tokens, sampled.tokens), logprobs=write(out.logprobs, sampled.logprobs),
                      versions=write(out.versions, sampled.versions), emitted=out.emitted + emit,
                      finish=jnp.where(finish > 0, finish, out.finish))
    control = control.replace(running=emit & (finish == 0), remaining=remaining, recent=recent)
    return i + 1, state, control, out

  out = CallOutput(tokens=jnp.zeros((slots, steps), jnp.int32), logprobs=jnp.zeros((slots, steps), jnp.float32),
                   versions=jnp.zeros((slots, steps), jnp.int32), emitted=jnp.zeros((slots,), jnp.int32),
                   finish=jnp.zeros((slots,), jnp.int32))
  _, state, control, out = jax.lax.while_loop(running, step, (jnp.int32(0), state, control, out))
  return state, control, out


@dataclasses.dataclass
class _Request:
  prompt: list[int]
  max_tokens: int
  options: SamplingOptions
  result: Future
  generation: Generation = dataclasses.field(default_factory=lambda: Generation([], [], [], None))


class InProcessBackend:
  """A `RolloutBackend` that generates in this process (see the module docstring)."""

  def __init__(self, model: Decoder, *, slots: int = 8, max_prefill_length: int = 64, max_length: int = 128,
               steps_per_call: int = 32, version: int = -1, seed: int = 0, mesh=None,
               admission_window_s: float = 0.002):
    """`model`: the weights to start from (copied: the learner's step donates its own buffers) and the
    architecture; `mesh`: the devices to generate on (the learner's; default: the first device);
    `admission_window_s`: how long an idle backend waits after a first request for others to join it
    (episode threads send theirs within a millisecond; a lone request pays this once)."""
    if jax.process_count() > 1:
      raise ValueError(f"the in-process backend generates in one process; this learner has "
                       f"{jax.process_count()}: use config.rollout.backend='jetstream'")
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call must be >= 1; got {steps_per_call}")
    graphdef, params = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
    self.engine = DecodeEngine(copy, slots=slots, max_prefill_length=max_prefill_length, max_length=max_length,
                               seed=seed, version=version, mesh=mesh)
    self.steps_per_call, self.admission_window_s = steps_per_call, admission_window_s
    eos = model.config.eos_token_id
    self._eos = int(eos) if eos is not None else -1
    self._limits = requests.Limits(vocab_size=model.config.vocab_size, max_prefill_length=max_prefill_length,
                                   max_length=max_length)
    self._run = jax.jit(self._run_impl, donate_argnums=(1, 2))
    self._pending: queue.Queue[_Request | None] = queue.Queue()
    self._lock = threading.Lock()                 # weight swaps against the driver's reads
    self._queue_lock = threading.Lock()           # requests against close()
    self._closed = False
    self.calls = {"prefill": 0, "decode": 0}
    self._thread = threading.Thread(target=self._drive, daemon=True, name="in-process-rollouts")
    self._thread.start()

  # --- the backend's calls ---------------------------------------------------

  def generate(self, token_ids, max_tokens: int, *, temperature=1.0, top_p=1.0, top_k=0, stop_sequences=(),
               seed: int | None = None) -> Generation:
    body = {"token_ids": [int(t) for t in token_ids], "max_tokens": max_tokens, "temperature": temperature,
            "top_p": top_p, "top_k": top_k, "stop_sequences": [[int(t) for t in s] for s in stop_sequences]}
    if seed is not None:
      body["seed"] = int(seed)
    parsed = requests.generate_request(body, self._limits)
    stops = parsed.stop_sequences
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > STOP_WINDOW for s in stops):
      raise ValueError(f"stop_sequences: the in-process backend takes at most {MAX_STOP_SEQUENCES} of at most "
                       f"{STOP_WINDOW} tokens each; got {[len(s) for s in parsed.stop_sequences]} tokens")
    options = SamplingOptions(SamplingParams(parsed.temperature, parsed.top_p, parsed.top_k),
                              parsed.stop_sequences, parsed.seed)
    request = _Request(parsed.token_ids, parsed.max_tokens, options, Future())
    with self._queue_lock:          # a request queued ahead of close()'s end marker is answered or failed
      if self._closed:
        raise RuntimeError("the in-process backend is closed")
      self._pending.put(request)
    return request.result.result()

  def push(self, update: WeightUpdate) -> None:
    """Arrays are placed as the served weights; a directory ("path", "stream") is read here."""
    if update.kind == "bytes":
      raise ValueError("the in-process backend takes weights as arrays or a directory, not bytes")
    weights = update.payload if update.kind == "arrays" else self.engine.read_weights(update.payload)
    with self._lock:
      self.engine.store.update(weights, update.version, update.reset)

  def status(self) -> list[ServerStatus]:
    e = self.engine
    report = {"version": e.store.version, "max_prefill_length": e.max_prefill_length,
              "max_length": e.max_length, "max_concurrent_decodes": e.slots,
              "queue_length": self._pending.qsize(),
              "compilations": dict(e.trace_counts), "engine_calls": dict(self.calls),
              "decode_steps": self.steps_per_call, "mesh": {k: int(v) for k, v in e.mesh.shape.items()},
              "model": json.loads(json.dumps(dataclasses.asdict(e.config)))}     # as a server reports it
    return [ServerStatus("in-process", healthy=not self._closed, report=report)]

  def close(self) -> None:
    with self._queue_lock:
      if self._closed:
        return
      self._closed = True
      self._pending.put(None)
    self._thread.join(timeout=60)

  # --- the driver thread -----------------------------------------------------

  def _run_impl(self, params, state, control, version):
    return decode_until_done(self.engine.model(params), state, control, version, steps=self.steps_per_call,
                             max_length=self.engine.max_length, eos_id=self._eos)

  def _drive(self) -> None:
    engine = self.engine
    state, busy = engine.init_decode_state(), {}
    control = _host_control(engine.slots)
    try:
      while True:
        state, closing = self._admit(state, control, busy)
        if closing:
          for waiting in busy.values():
            waiting.result.set_exception(RuntimeError("the in-process backend was closed"))
          return
        with self._lock:
          weights, version = engine.store.get_for_device()
        self.calls["decode"] += 1
        state, control, out = self._run(weights, state, jax.device_put(control), version)
        out, control = jax.device_get((out, control))
        control = jax.tree.map(np.array, control)      # writable host copies for the next admissions
        for slot, request in list(busy.items()):
          n, g = int(out.emitted[slot]), request.generation
          g.token_ids += out.tokens[slot, :n].tolist()
          g.logprobs += out.logprobs[slot, :n].tolist()
          g.versions += out.versions[slot, :n].tolist()
          if out.finish[slot]:
            g.finish_reason = FINISH_REASONS[int(out.finish[slot])]
            request.result.set_result(g)
            del busy[slot]
    except BaseException as err:  # noqa: BLE001 - every waiting caller gets the error, none hangs
      with self._queue_lock:
        self._closed = True
        waiting = [*busy.values(), *_drain(self._pending)]
      for request in waiting:
        if request is not None and not request.result.done():
          request.result.set_exception(err)

  def _admit(self, state, control: SlotControl, busy: dict):
    """Prefill waiting requests into free slots, together in one device call; (state, whether the
    backend is closing). With no slot busy it waits for a first request, then up to
    `admission_window_s` for more, so requests sent together start together."""
    free = [s for s in range(self.engine.slots) if s not in busy]
    admitted, deadline = [], None
    while len(admitted) < len(free):
      try:
        if busy or admitted and deadline is None:
          request = self._pending.get_nowait()
        elif not admitted:
          request = self._pending.get()
        else:
          request = self._pending.get(timeout=max(deadline - time.monotonic(), 0.0))
      except queue.Empty:
        break
      if request is None:
        for slot, waiting in zip(free, admitted):
          busy[slot] = waiting               # failed by `_drive` with the rest
        return state, True
      admitted.append(request)
      if deadline is None and not busy and self.admission_window_s > 0:
        deadline = time.monotonic() + self.admission_window_s
    if not admitted:
      return state, False
    prompts = []
    for slot, request in zip(free, admitted):
      busy[slot] = request           # from here on, a failure reaches its caller (`_drive`)
      prompts.append(SlotPrompt(slot, request.prompt, request.options))
      _set_slot(control, slot, request)
    with self._lock:
      served = self.engine.store.get()
    self.calls["prefill"] += 1
    return self.engine.prefill_into_slots(served, prompts, state), False


def _host_control(slots: int) -> SlotControl:
  return SlotControl(running=np.zeros(slots, bool), remaining=np.zeros(slots, np.int32),
                     stops=np.full((slots, MAX_STOP_SEQUENCES, STOP_WINDOW), -1, np.int32),
                     stop_lengths=np.zeros((slots, MAX_STOP_SEQUENCES), np.int32),
                     recent=np.full((slots, STOP_WINDOW), -1, np.int32))


def _set_slot(control: SlotControl, slot: int, request: _Request) -> None:
  control.running[slot], control.remaining[slot] = True, request.max_tokens
  control.stops[slot], control.stop_lengths[slot], control.recent[slot] = -1, 0, -1
  for n, sequence in enumerate(request.options.stop_sequences):
    control.stops[slot, n, STOP_WINDOW - len(sequence):] = sequence
    control.stop_lengths[slot, n] = len(sequence)


def _drain(pending: queue.Queue) -> list:
  items = []
  while True:
    try:
      items.append(pending.get_nowait())
    except queue.Empty:
      return items

