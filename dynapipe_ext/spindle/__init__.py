"""Spindle (arXiv 2409.03365): wavefront scheduling of multi-task multi-modal models.

Framework-free planner: model description (`model`), graph contraction into MetaOps and
MetaLevels (`contraction`), scalability estimator (`estimator`), malleable allocator
(`allocator`), greedy wavefront scheduler with device placement and the two baselines
(`scheduler`), and a checker for the resulting wave plans (`checker`). The megatron-side
runtime lives in `megatron/spindle/`.
"""
