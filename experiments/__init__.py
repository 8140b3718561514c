"""Ready experiment specs (package data: trimlab.resources)."""
