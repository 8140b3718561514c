"""`trimlab run`: an experiment (or every point of its sweep) from spec to run directory.

    spec validated → rack (virtual: brought up here; or a lab inventory) → provision with the
    run's profile → counters, sampler, captures, traffic → workers and ps over SSH, with
    progress → everything stopped → artifacts collected over SFTP → manifest → report.

A failed or interrupted run stops every agent, keeps what was collected, says why in its
manifest, takes the virtual rack down, and exits 1.

By concern: `placement` (which host runs what, the agents' configuration, checks before
anything is touched), `launch` (the agents' command lines), `events` (the typed JSON lines
agents print), `monitor` (agents' health and training progress), `progress` (the rich view
of it), `collect` (artifacts and results), `execution` (one run's phases), `sweep` (the
command: every point, one rack).
"""

from trimlab.testbed.orchestrator.placement import RunFailed
from trimlab.testbed.orchestrator.sweep import run

__all__ = ["RunFailed", "run"]
