"""Programs that run on the rack hosts (started over SSH by trimlab.remote):
`python -m trimlab.agents.<name> --help`."""
