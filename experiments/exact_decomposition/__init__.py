"""exact_decomposition: see README.md beside this file."""
