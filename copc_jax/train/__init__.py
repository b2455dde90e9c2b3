"""The learner: batches of trajectories in, actor and critic updates out."""

from copc_jax.train.batch import TrajectoryBatch
from copc_jax.train.learner import Learner, LearnerConfig, OptimizerConfig

__all__ = ["TrajectoryBatch", "Learner", "LearnerConfig", "OptimizerConfig"]
