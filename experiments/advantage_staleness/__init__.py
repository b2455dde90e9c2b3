"""advantage_staleness: see README.md beside this file."""
