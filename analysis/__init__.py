"""Analysis of run directories: captures, matching, figures and the report."""
