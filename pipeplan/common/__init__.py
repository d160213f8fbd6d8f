"""Helpers every layer may use: atomic, non-destructive output files."""
