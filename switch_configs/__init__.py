"""Trimming profiles and per-target templates (package data: trimlab.resources)."""
