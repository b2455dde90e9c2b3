"""search_stability: see README.md beside this file."""
