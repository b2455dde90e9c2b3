"""The studies and benchmarks of copc_jax, run as modules from the repository root:

    python -m experiments.presets_across_staleness.run --help
    python -m experiments.bench_rollout --help

Each study lives in its folder with its command (`run.py`), its results JSON, its figures and a README
rendered from the JSON; `experiments.study` runs grids of the main job for them."""
