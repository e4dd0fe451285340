"""Benchmarks of the serving stack against peer servers on the same CPUs."""
