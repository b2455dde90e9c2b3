"""Rollout: a JetStream engine and server for the copc_jax decoder, and their clients."""
