"""Example scripts (package data: trimlab.resources)."""
