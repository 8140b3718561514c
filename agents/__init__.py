"""Programs that run on the rack hosts (started over SSH by trimlab.testbed.remote):
`python -m trimlab.agents.<name> --help`."""
