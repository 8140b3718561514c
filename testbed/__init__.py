"""trimlab: a testbed for ML training over packet-trimming switches."""

__version__ = "0.1.0"
