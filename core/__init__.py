"""trimlab: a testbed for ML training over packet-trimming switches.

From a notebook: `trimlab.load_run(path)`, `trimlab.compare(runs)`, `trimlab.list_runs(dir)`
(trimlab.analysis.notebook; imported on first use, so `import trimlab` stays light on NIC
hosts, where the analysis's libraries are not installed)."""

__version__ = "0.1.0"

_NOTEBOOK = ("load_run", "compare", "list_runs")


def __getattr__(name: str):
    if name in _NOTEBOOK:
        from trimlab.analysis import notebook
        return getattr(notebook, name)
    raise AttributeError(f"module 'trimlab' has no attribute {name!r}")
