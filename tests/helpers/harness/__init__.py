"""Test infrastructure for many hosts on one machine: network namespaces (hosts.py) and a real Slurm
cluster (slurm.py). See docs/testing.md."""
