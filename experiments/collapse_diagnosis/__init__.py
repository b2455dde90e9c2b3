"""collapse_diagnosis: see README.md beside this file."""
