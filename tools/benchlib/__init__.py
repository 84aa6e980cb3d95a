"""Shared code of the benchmark tools (tools/*.py import it; no tool imports another tool):
the machine line of a report, a free port for a launcher, and the throughput plots. Workloads,
tables and the docs-section writer live in the library (dynapipe_ext.batching.synthetic,
dynapipe_ext.report)."""
