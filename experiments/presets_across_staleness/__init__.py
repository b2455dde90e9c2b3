"""presets_across_staleness: see README.md beside this file."""
