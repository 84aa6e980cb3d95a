"""Reports of the benchmarks: docs sections of docs/BENCHMARKS.md and the markdown tables the
benchmark tools write into them. Plain Python; no plotting, no I/O beyond the docs file."""
