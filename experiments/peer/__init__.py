"""The peer benchmark's other side: `tunix_ppo.py` runs in a Python environment of its own."""
