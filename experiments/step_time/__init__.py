"""step_time: see README.md beside this file."""
