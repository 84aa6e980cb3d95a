"""Shared code of the benchmark tools (tools/*.py import it; no tool imports another tool):
the machine line of a report, a free port for a launcher, a torchrun group run to its end or
its time limit, and the throughput plots. Workloads, tables and the docs-section writer live
in the library (dynapipe_ext.batching.synthetic, dynapipe_ext.report)."""
