"""joint_sweep: see README.md beside this file."""
