"""Start one copc_jax JetStream server.

  python -m copc_jax.rollout.serve --checkpoint=DIR --port=PORT [--slots=4 --max_prefill_length=64 ...]

Binds 127.0.0.1 unless --host says otherwise. --port=0 picks a free port; with
--ready_file the bound port is written there once the server accepts requests. The JAX platform
is the environment's (`JAX_PLATFORMS`: a TPU VM's chips, a GPU, or the CPU).
"""

import asyncio
import sys

from absl import app, flags, logging

from copc_jax import parent_watchdog

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "Hugging Face checkpoint directory (config.json + safetensors).")
flags.DEFINE_integer("port", 0, "Port to bind; 0 picks a free one.")
flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
flags.DEFINE_integer("slots", 4, "Concurrent generations (JetStream's max_concurrent_decodes).")
flags.DEFINE_integer("max_prefill_length", 64, "Prompt bucket: one of 16, 32, 64, ..., 32768.")
flags.DEFINE_integer("max_length", 256, "Prompt + generated tokens per slot.")
flags.DEFINE_string("tokenizer", None, "Directory with tokenizer files (default: the checkpoint's, if it has "
                    "them). Without one only token-id requests work; text prompts are refused.")
flags.DEFINE_integer("tensor_parallelism", -1, "Devices of this host to serve on, the model split over them "
                     "(tensor parallel); -1: all of them.")
flags.DEFINE_integer("data_parallelism", 1, "Groups of devices the slots split over, each with a whole "
                     "tensor-parallel copy of the model (the KV cache's slots over `data`: how a cache "
                     "whose few KV heads do not divide the devices still splits).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights, compute and KV cache dtype.")
flags.DEFINE_integer("decode_steps", 1, "Tokens decoded per slot in one engine call (on the device).")
flags.DEFINE_integer("calls_ahead", 2, "Generate calls that may wait for the detokenizer (JetStream's "
                     "default: 8); each decodes finished slots for nothing until the detokenizer frees them.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("version", 0, "Version of the initial weights.")
flags.DEFINE_string("ready_file", None, "Write the bound port here once serving.")
flags.DEFINE_string("auth_token_file", "", "File holding the shared token every call must carry (default: "
                    "$COPC_AUTH_TOKEN; required unless --host is a loopback address).")
flags.DEFINE_list("weights_root", None, "Directories UpdateWeights may read weights from (symlinks resolved); "
                  "required unless --host is a loopback address.")
flags.DEFINE_string("tls_cert", "", "PEM certificate chain: serve over TLS (with --tls_key).")
flags.DEFINE_string("tls_key", "", "PEM private key of --tls_cert.")
flags.DEFINE_bool("log_steps", False, "Keep JetStream's per-step INFO logs (slow: several lines per step).")
flags.DEFINE_bool("exit_with_parent", False, "Exit when the process that started this one dies "
                  "(set by the trainer's pool, so a SIGKILLed trainer leaves no servers behind).")
flags.mark_flag_as_required("checkpoint")


def main(argv):
  del argv
  if FLAGS.exit_with_parent:
    parent_watchdog.exit_when_orphaned()
  from copc_jax.models import hf_io
  from copc_jax.rollout import auth
  from copc_jax.rollout.engine import SERVING_RULES, serving_mesh
  from copc_jax.rollout.jetstream_adapter import CopcEngine

  try:                    # refused before the model loads: one line, exit status 2
    token = auth.resolve_token(FLAGS.auth_token_file)
    auth.check_bind(FLAGS.host, token)
    if FLAGS.weights_root is None and not auth.is_loopback(FLAGS.host):
      raise ValueError(f"--host={FLAGS.host} is reachable from the network: give --weights_root")
    if bool(FLAGS.tls_cert) != bool(FLAGS.tls_key):
      raise ValueError("--tls_cert and --tls_key go together")
  except (OSError, ValueError) as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
  from copc_jax.rollout.server import serve

  try:
    mesh = serving_mesh(FLAGS.tensor_parallelism, data_parallelism=FLAGS.data_parallelism)
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
  model, tokenizer = hf_io.from_pretrained(FLAGS.checkpoint, load_tokenizer=not FLAGS.tokenizer, mesh=mesh,
                                           rules=SERVING_RULES, dtype=FLAGS.dtype)
  if FLAGS.tokenizer:
    tokenizer = hf_io.load_tokenizer(FLAGS.tokenizer, needed_for="--tokenizer")
  if tokenizer is None:
    logging.warning("%s has no tokenizer (give --tokenizer): text prompts of the stock Decode API are "
                    "refused; token-id prompts work", FLAGS.checkpoint)
  engine = CopcEngine(model, max_concurrent_decodes=FLAGS.slots,
                      max_prefill_length=FLAGS.max_prefill_length, max_length=FLAGS.max_length,
                      tokenizer=tokenizer, seed=FLAGS.seed, version=FLAGS.version, mesh=mesh,
                      decode_steps=FLAGS.decode_steps)
  logging.info("serving %s on %s:%d over %s", FLAGS.checkpoint, FLAGS.host, FLAGS.port, dict(mesh.shape))
  if not FLAGS.log_steps:
    # JetStream 0.2.2 logs several INFO lines on the root logger for every decode step.
    logging.set_verbosity(logging.WARNING)
  credentials = auth.server_credentials(FLAGS.tls_cert, FLAGS.tls_key) if FLAGS.tls_cert else None
  asyncio.run(serve(engine, FLAGS.port, FLAGS.host, FLAGS.ready_file, calls_ahead=FLAGS.calls_ahead,
                    token=token, weights_roots=tuple(FLAGS.weights_root) if FLAGS.weights_root else None,
                    credentials=credentials))


if __name__ == "__main__":
  app.run(main)
