"""copc_jax: asynchronous actor-critic RL for LLMs with Coupled Off-Policy Correction."""

__version__ = "0.1.0"
