"""Turning public RL datasets into the tasks' rows (`python -m copc_jax.data.prepare`)."""
