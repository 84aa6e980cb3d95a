"""An iteration's execution plan: the iteration planner that runs batching and schedule search,
lowering to per-rank instructions, the plan checker, serialisation, traces and cluster-scale
planner placement."""
