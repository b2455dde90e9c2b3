"""copc_default: see README.md beside this file."""
