"""The Ansible playbooks and roles (package data: trimlab.resources)."""
