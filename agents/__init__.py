"""Programs that run on the rack hosts (started over SSH by testbed.remote):
`python -m agents.<name> --help`."""
