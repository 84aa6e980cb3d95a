"""FlexTP planning (arXiv 2401.11469): uneven tensor-parallel partitions of attention heads and
MLP column groups, straggler detection from measured per-rank compute times, ZERO-resizing
(drop and impute a bounded share of a straggler's slices), migration plans and the SEMI policy
that picks between them. Plain Python; the layers that apply these plans live in megatron/flextp."""
