"""Benchmarks: each reports what it measured, with the machine and the command."""
