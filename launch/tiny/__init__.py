"""Tiny random-weight checkpoints for the tests, the benchmarks and `wideep demo` / `make-tiny`."""
