"""The serving engine's state and jitted bodies, in pure JAX: what JetStream (`jetstream_adapter.py`)
and the in-process backend (`in_process.py`) both run.

Continuous batching over `slots`. Each slot keeps its own KV cache row (slot index == token
position), its next-token logits, the weights version that computed them, and the request's
sampling options. One decode step (`decode_step`) samples a token per slot from the stored logits
(see `sampling.py` for the distribution and its log-probability), then runs the model on it to get
the next logits. `DecodeEngine.generate_step` packs, per slot and step, the columns
token | valid | length | log-probability (float32 bits) | version into one int32 array for the host.

Weights live in a `ParamStore`: every call reads (weights, version) from it and passes the weights to
jitted functions as arguments, so swapping weights of the same shapes and shardings neither restarts
nor recompiles. A swap during a generation takes effect at the next step: tokens record the version
whose logits they were sampled from, and the KV cache keeps what earlier versions wrote (in-flight
update).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from copc_jax import sampling, sharding
from copc_jax.models import hf_io
from copc_jax.models.decoder import Decoder, KVCache

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# The int32 columns of one decode step in `generate_step`'s output, per slot.
TOKEN_COLUMN, VALID_COLUMN, LENGTH_COLUMN = 0, 1, 2
LOGPROB_COLUMN = 3   # float32 log-probability, bit-cast to int32
VERSION_COLUMN = 4   # weights version that produced the token
COLUMNS = 5


def prefill_bucket(length: int, max_prefill_length: int) -> int:
  """The padded length of a `length`-token prompt: the smallest bucket that holds it (JetStream's
  `take_nearest_length` over `PREFILL_BUCKETS` up to `max_prefill_length`)."""
  for bucket in (*[b for b in PREFILL_BUCKETS if b < max_prefill_length], max_prefill_length):
    if length <= bucket:
      return bucket
  raise ValueError(f"a prompt of {length} tokens exceeds max_prefill_length {max_prefill_length}")


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
  """Per-request sampling, the request's seed, and token sequences that end the generation.

  With a `seed`, token i of the generation is drawn with fold_in(key(seed), i):
  the same request gives the same tokens whatever the server, slot or arrival
  order. Without one, the server draws a seed from its own stream.
  """

  params: sampling.SamplingParams = sampling.SamplingParams()
  stop_sequences: tuple[tuple[int, ...], ...] = ()
  seed: int | None = None

  def __post_init__(self):
    if any(len(s) == 0 for s in self.stop_sequences):
      raise ValueError("stop_sequences must not contain an empty sequence")
    if self.seed is not None and not (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                      and 0 <= self.seed < 2**32):
      raise ValueError(f"seed must be an integer in [0, 2**32); got {self.seed!r}")


class ParamStore:
  """The served weights and their version; swapped atomically, read at every engine call."""

  def __init__(self, params, version: int = 0):
    self._lock = threading.Lock()
    self._params, self._version = params, version
    self._version_array = jnp.int32(version)

  def get(self):
    with self._lock:
      return self._params, self._version

  def get_for_device(self):
    """(weights, version as a device scalar): no host-to-device copy per decode step."""
    with self._lock:
      return self._params, self._version_array

  @property
  def version(self) -> int:
    return self.get()[1]

  def update(self, params, version: int, reset: bool = False) -> None:
    """Replace the weights; they must have the current structure, shapes and dtypes. Versions
    increase, except that `reset` starts a new sequence (a new run on a server kept alive)."""
    current, current_version = self.get()
    if version <= current_version and not reset:
      raise ValueError(f"version must increase: got {version}, serving {current_version} "
                       f"(a new run starts its versions with reset)")
    old_leaves, treedef = jax.tree.flatten(current)
    new_leaves = jax.tree.leaves(params)
    if len(new_leaves) != len(old_leaves):
      raise ValueError(f"weights have {len(new_leaves)} arrays; the model has {len(old_leaves)}")
    placed = []
    for i, (old, new) in enumerate(zip(old_leaves, new_leaves, strict=True)):
      if tuple(np.shape(new)) != tuple(old.shape):
        raise ValueError(f"weight #{i}: shape {tuple(np.shape(new))} != served shape {tuple(old.shape)}")
      placed.append(jax.device_put(jnp.asarray(new, old.dtype), old.sharding))
    placed = jax.block_until_ready(jax.tree.unflatten(treedef, placed))
    version_array = jnp.int32(version)
    with self._lock:
      self._params, self._version, self._version_array = placed, version, version_array


@struct.dataclass
class Prefix:
  keys: jax.Array          # [L, 1, P, KV, D]
  values: jax.Array
  true_length: jax.Array   # []
  last_logits: jax.Array   # [V]
  version: jax.Array       # []
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array
  seed: jax.Array          # [] uint32: the request's sampling key is key(seed)
  stop_sequences: tuple = struct.field(pytree_node=False, default=())


@struct.dataclass
class DecodeState:
  cache: KVCache              # batch = slots
  lengths: jax.Array          # [S] tokens in the row (= slot of the next token)
  generated: jax.Array        # [S]
  logits: jax.Array           # [S, V] next-token logits
  logits_version: jax.Array   # [S]
  temperature: jax.Array      # [S]
  top_p: jax.Array            # [S]
  top_k: jax.Array            # [S]
  key_data: jax.Array         # [S, 2] uint32: each slot's request key; token i uses fold_in(key, i)


# Serving is tensor-parallel: the model dimensions go over the `tensor` axis, nothing over fsdp (every
# decode step needs all of each layer), and the KV cache splits with the KV heads. With a `data` axis
# the slots split too: each data group decodes its own slots with a whole copy of the (tensor-split)
# model, which is how a cache whose few KV heads do not divide the chips still splits.
SERVING_RULES: tuple = (("batch", None), ("vocab", "tensor"), ("embed", None), ("heads", "tensor"),
                        ("kv_heads", "tensor"), ("mlp", "tensor"), ("norm", None))


def serving_mesh(tensor_parallelism: int = 1, devices=None, *, data_parallelism: int = 1):
  """A (data_parallelism, 1, tensor_parallelism) mesh over this host's first devices (tensor −1: all of
  them that the data groups leave)."""
  devices = list(devices if devices is not None else jax.local_devices())
  if data_parallelism < 1 or len(devices) % data_parallelism:
    raise ValueError(f"data_parallelism must divide this host's {len(devices)} devices; got {data_parallelism}")
  per_group = len(devices) // data_parallelism
  tensor = per_group if tensor_parallelism == -1 else tensor_parallelism
  if not 1 <= tensor <= per_group:
    raise ValueError(f"tensor_parallelism must be -1 or 1..{per_group} (this host's devices / "
                     f"data_parallelism); got {tensor_parallelism}")
  count = data_parallelism * tensor
  return sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(data_parallelism, 1, tensor)), devices[:count])


def cache_partition(config, mesh, slots: int) -> jax.sharding.PartitionSpec:
  """The KV cache [L, slots, S, KV, D] over a serving mesh: KV heads over `tensor` where they divide
  it, slots over `data` where they divide it."""
  tensor = mesh.shape["tensor"]
  heads = "tensor" if tensor > 1 and config.num_kv_heads % tensor == 0 else None
  return jax.sharding.PartitionSpec(None, slot_axis(mesh, slots), None, heads, None)


def slot_axis(mesh, slots: int):
  """The mesh axis the per-slot arrays split over: `data`, where it divides the slots."""
  data = mesh.shape["data"]
  return "data" if data > 1 and slots % data == 0 else None


@struct.dataclass
class StepOutput:
  """One decode step, per slot: the token sampled, its log-probability and the weights version of
  the logits it was sampled from."""

  tokens: jax.Array           # [S] int32
  logprobs: jax.Array         # [S] float32
  versions: jax.Array         # [S] int32


def decode_step(model: Decoder, state: DecodeState, version, max_length: int) -> tuple[DecodeState, StepOutput]:
  """Sample a token per slot from its stored logits with key fold_in(slot key, tokens generated), run the
  model on it, and store the next logits (computed by weights `version`)."""
  keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(state.key_data), state.generated)
  tokens, logprobs = sampling.sample(keys, state.logits, state.temperature, state.top_p, state.top_k)
  # Free slots keep stepping on garbage; keep their writes inside the cache.
  rows = jnp.minimum(state.lengths, max_length - 1)
  logits, cache = model.decode_rows(tokens, rows, state.cache)
  out = StepOutput(tokens.astype(jnp.int32), logprobs.astype(jnp.float32), state.logits_version)
  return state.replace(cache=cache, lengths=state.lengths + 1, generated=state.generated + 1, logits=logits,
                       logits_version=jnp.full_like(state.logits_version, version)), out


@dataclasses.dataclass(frozen=True)
class SlotPrompt:
  """A prompt to prefill into `slot` (`prefill_into_slots`)."""

  slot: int
  tokens: list[int]
  options: SamplingOptions


def rows_bucket(count: int, slots: int) -> int:
  """Rows of a batched prefill of `count` prompts: the next power of two, at most `slots` (few shapes)."""
  return min(1 << max(count - 1, 0).bit_length(), slots)


class DecodeEngine:
  """The served model: weights in a `ParamStore`, a decode state over `slots`, and four jitted
  bodies — `prefill` (one prompt → its KV cache and last logits), `insert` (a prefix into a slot),
  `prefill_slots` (several prompts prefilled together, each into its slot) and `generate_step`
  (`decode_steps` decode steps of every slot, packed as `COLUMNS` int32 columns).

  `mesh`: the devices to serve on (`serving_mesh`; default: the first device alone). Weights are
  placed by `SERVING_RULES` (`place_weights=False`: kept where they are, e.g. the learner's own
  placement) and keep their placement across weight swaps. Tokens do not depend on `decode_steps`
  (a token's key is the request's key and its index)."""

  def __init__(self, model: Decoder, *, slots: int = 4, max_prefill_length: int = 64, max_length: int = 256,
               seed: int = 0, version: int = 0, mesh=None, decode_steps: int = 1, place_weights: bool = True):
    if decode_steps < 1:
      raise ValueError(f"decode_steps must be >= 1; got {decode_steps}")
    if max_prefill_length not in PREFILL_BUCKETS:
      raise ValueError(f"max_prefill_length must be one of {PREFILL_BUCKETS}; got {max_prefill_length}")
    if max_length <= max_prefill_length:
      raise ValueError(f"max_length ({max_length}) must exceed max_prefill_length ({max_prefill_length})")
    self.decode_steps = decode_steps
    self.config = model.config
    self.cache_dtype = model.model.dtype     # the KV cache in the model's compute dtype (bf16 halves it)
    self._graphdef, params = nnx.split(model)
    self._mesh = mesh if mesh is not None else serving_mesh(1)
    if place_weights:
      params = jax.device_put(params, sharding.state_shardings(params, self._mesh, SERVING_RULES))
    self.store = ParamStore(params, version)
    self._slots, self._prefill_len, self._max_length = slots, max_prefill_length, max_length
    self._seed_stream, self._seed_lock = np.random.default_rng(seed), threading.Lock()
    names = ("prefill", "generate", "insert", "prefill_slots")
    self.trace_counts = dict.fromkeys(names, 0)
    self.calls = dict.fromkeys(names, 0)              # every call, traced or not
    self.compile_s = dict.fromkeys(names, 0.0)        # calls that traced: compile + run
    # The decode state keeps one placement across calls (else a state coming out of `generate` would
    # differ from a fresh one and `insert` would compile again).
    self.state_shardings = jax.tree.map(lambda x: x.sharding, self.init_decode_state())
    self.replicated = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())
    self._prefill_jit = jax.jit(self._prefill_impl)
    self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=self.state_shardings)
    self._prefill_slots_jit = jax.jit(self._prefill_slots_impl, donate_argnums=(1,),
                                      out_shardings=self.state_shardings)
    self._generate_jit = jax.jit(self._generate_impl, donate_argnums=(1,),
                                 out_shardings=(self.state_shardings, self.replicated))

  def model(self, params) -> Decoder:
    return nnx.merge(self._graphdef, params)

  def read_weights(self, source):
    """Weights in the served structure and placement from `source` (a checkpoint directory, or Hugging
    Face tensors in memory), ready for `store.update`."""
    return nnx.split(hf_io.read_like(nnx.merge(self._graphdef, self.store.get()[0]), source))[1]

  # --- jitted bodies -------------------------------------------------------

  def _prefill_impl(self, params, padded_tokens_p, true_length):
    self.trace_counts["prefill"] += 1
    model = self.model(params)
    p = padded_tokens_p.shape[0]
    cache = KVCache.create(self.config, batch=1, max_length=p, dtype=self.cache_dtype)
    valid = (jnp.arange(p) < true_length)[None]
    logits, cache = model.decode(padded_tokens_p[None], jnp.arange(p)[None], cache, valid)
    return cache.keys, cache.values, logits[0, true_length - 1]

  def _insert_impl(self, prefix: Prefix, state: DecodeState, slot):
    self.trace_counts["insert"] += 1
    cache = state.cache
    keys = jax.lax.dynamic_update_slice(cache.keys, prefix.keys.astype(cache.keys.dtype), (0, slot, 0, 0, 0))
    values = jax.lax.dynamic_update_slice(cache.values, prefix.values.astype(cache.values.dtype),
                                          (0, slot, 0, 0, 0))
    row_valid = jnp.arange(cache.valid.shape[1]) < prefix.true_length
    return state.replace(
        cache=cache.replace(keys=keys, values=values, valid=cache.valid.at[slot].set(row_valid)),
        lengths=state.lengths.at[slot].set(prefix.true_length),
        generated=state.generated.at[slot].set(0),
        logits=state.logits.at[slot].set(prefix.last_logits),
        logits_version=state.logits_version.at[slot].set(prefix.version),
        temperature=state.temperature.at[slot].set(prefix.temperature),
        top_p=state.top_p.at[slot].set(prefix.top_p),
        top_k=state.top_k.at[slot].set(prefix.top_k),
        key_data=state.key_data.at[slot].set(jax.random.key_data(jax.random.key(prefix.seed))))

  def _prefill_slots_impl(self, params, state: DecodeState, rows: dict, version):
    """Prefill the padded prompts `rows["tokens"]` [R, P] together and write row r into slot
    `rows["slot"][r]` as `_insert_impl` writes a prefix; rows whose slot is `slots` (padding) are dropped."""
    self.trace_counts["prefill_slots"] += 1
    model = self.model(params)
    r, p = rows["tokens"].shape
    cache = KVCache.create(self.config, batch=r, max_length=p, dtype=self.cache_dtype)
    valid = jnp.arange(p)[None] < rows["true_length"][:, None]
    logits, cache = model.decode(rows["tokens"], jnp.broadcast_to(jnp.arange(p), (r, p)), cache, valid)
    last_logits = logits[jnp.arange(r), rows["true_length"] - 1]
    slot, old = rows["slot"], state.cache
    put = lambda target, new: target.at[slot].set(new.astype(target.dtype), mode="drop")
    put_prefix = lambda target, new: target.at[:, slot, :p].set(new.astype(target.dtype), mode="drop")
    row_valid = jnp.arange(old.valid.shape[1])[None] < rows["true_length"][:, None]
    return state.replace(
        cache=old.replace(keys=put_prefix(old.keys, cache.keys), values=put_prefix(old.values, cache.values),
                          valid=put(old.valid, row_valid)),
        lengths=put(state.lengths, rows["true_length"]), generated=put(state.generated, jnp.zeros_like(slot)),
        logits=put(state.logits, last_logits),
        logits_version=put(state.logits_version, jnp.full_like(slot, version)),
        temperature=put(state.temperature, rows["temperature"]), top_p=put(state.top_p, rows["top_p"]),
        top_k=put(state.top_k, rows["top_k"]),
        key_data=put(state.key_data, jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(rows["seed"])))

  def _generate_impl(self, params, state: DecodeState, version):
    """`decode_steps` decode steps; data [slots, COLUMNS × decode_steps]: per step the columns
    token, valid, generated count, log-prob bits, version."""
    self.trace_counts["generate"] += 1
    model = self.model(params)

    def step(state, _):
      state, out = decode_step(model, state, version, self._max_length)
      data = jnp.stack([out.tokens, jnp.ones_like(state.generated), state.generated,
                        jax.lax.bitcast_convert_type(out.logprobs, jnp.int32), out.versions], axis=1)
      return state, data

    if self.decode_steps == 1:
      return step(state, None)
    state, data = jax.lax.scan(step, state, None, length=self.decode_steps)     # data [steps, slots, 5]
    return state, jnp.transpose(data, (1, 0, 2)).reshape(data.shape[1], -1)

  # --- calls -----------------------------------------------------------------

  def prefill_prompt(self, weights_and_version, padded_tokens, true_length: int,
                     options: SamplingOptions | None = None) -> Prefix:
    """The prefix of one padded prompt under (weights, version), with the request's sampling options
    (a request without a seed gets one from this engine's own stream)."""
    weights, version = weights_and_version
    keys, values, last_logits = self._timed("prefill", self._prefill_jit, weights,
                                            np.asarray(padded_tokens, np.int32), np.int32(true_length))
    options = options or SamplingOptions()
    seed = options.seed if options.seed is not None else self._unseeded_requests()
    p = options.params
    # The scalars stay on the host (numpy) until `insert` takes them in: no device op per field.
    return Prefix(keys=keys, values=values, true_length=np.int32(true_length), last_logits=last_logits,
                  version=np.int32(version), temperature=np.float32(p.temperature), top_p=np.float32(p.top_p),
                  top_k=np.int32(p.top_k), seed=np.uint32(seed), stop_sequences=options.stop_sequences)

  def insert_prefix(self, prefix: Prefix, state: DecodeState, slot: int) -> DecodeState:
    return self._timed("insert", self._insert_jit, prefix, state, np.int32(slot))

  def prefill_into_slots(self, weights_and_version, prompts: list[SlotPrompt],
                         state: DecodeState) -> DecodeState:
    """`prompts` prefilled together under (weights, version), each into its slot: the same prefixes as
    `prefill_prompt` + `insert_prefix` one at a time, in one device call (rows padded to
    `rows_bucket`, tokens to the longest prompt's `prefill_bucket`)."""
    weights, version = weights_and_version
    count = rows_bucket(len(prompts), self._slots)
    width = prefill_bucket(max(len(p.tokens) for p in prompts), self._prefill_len)
    rows = {"tokens": np.zeros((count, width), np.int32), "true_length": np.ones(count, np.int32),
            "slot": np.full(count, self._slots, np.int32), "temperature": np.ones(count, np.float32),
            "top_p": np.ones(count, np.float32), "top_k": np.zeros(count, np.int32),
            "seed": np.zeros(count, np.uint32)}
    for row, prompt in enumerate(prompts):
      p, seed = prompt.options.params, prompt.options.seed
      rows["tokens"][row, :len(prompt.tokens)] = prompt.tokens
      rows["true_length"][row], rows["slot"][row] = len(prompt.tokens), prompt.slot
      rows["temperature"][row], rows["top_p"][row], rows["top_k"][row] = p.temperature, p.top_p, p.top_k
      rows["seed"][row] = seed if seed is not None else self._unseeded_requests()
    return self._timed("prefill_slots", self._prefill_slots_jit, weights, state, rows, np.int32(version))

  def generate_step(self, state: DecodeState):
    """(state, data [slots, COLUMNS × decode_steps] int32) with the weights served now."""
    weights, version = self.store.get_for_device()
    return self._timed("generate", self._generate_jit, weights, state, version)

  def _timed(self, name: str, jitted, *args):
    """Call `jitted`; a call that traced (compiled) adds its wall time to `compile_s[name]`."""
    self.calls[name] += 1
    traces, start = self.trace_counts[name], time.perf_counter()
    out = jitted(*args)
    if self.trace_counts[name] != traces:
      jax.block_until_ready(out)
      self.compile_s[name] += time.perf_counter() - start
    return out

  def _unseeded_requests(self) -> int:
    """A seed for a request that brought none (the stock `Decode` path): the engine's own stream."""
    with self._seed_lock:
      return int(self._seed_stream.integers(2**32))

  def cache_sharding(self):
    """The KV cache [L, B, S, KV, D]: KV heads over `tensor` and slots over `data` (where they divide)."""
    return jax.sharding.NamedSharding(self._mesh, cache_partition(self.config, self._mesh, self._slots))

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    s, v = self._slots, self.config.vocab_size
    replicated = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())
    put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(
        self._mesh, jax.sharding.PartitionSpec(slot_axis(self._mesh, s))))      # per-slot rows
    cache = KVCache.create(self.config, batch=s, max_length=self._max_length, dtype=self.cache_dtype)
    cache = cache.replace(keys=jax.device_put(cache.keys, self.cache_sharding()),
                          values=jax.device_put(cache.values, self.cache_sharding()), valid=put(cache.valid),
                          index=jax.device_put(cache.index, replicated))
    return DecodeState(
        cache=cache,
        lengths=put(jnp.zeros((s,), jnp.int32)), generated=put(jnp.zeros((s,), jnp.int32)),
        logits=put(jnp.zeros((s, v), jnp.float32)), logits_version=put(jnp.zeros((s,), jnp.int32)),
        temperature=put(jnp.ones((s,), jnp.float32)), top_p=put(jnp.ones((s,), jnp.float32)),
        top_k=put(jnp.zeros((s,), jnp.int32)),
        key_data=put(jnp.zeros((s, *jax.random.key_data(jax.random.key(0)).shape), jnp.uint32)))

  @property
  def slots(self) -> int:
    return self._slots

  @property
  def max_prefill_length(self):
    return self._prefill_len

  @property
  def max_length(self):
    return self._max_length

  @property
  def mesh(self):
    return self._mesh
