"""A script that fails on every rank at once, before doing anything distributed."""

raise SystemExit("plain_fail: this script always fails")
