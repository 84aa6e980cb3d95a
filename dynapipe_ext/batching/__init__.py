"""From a global batch to micro-batches: sample ordering, the dynamic program that cuts
micro-batches, the padding / token-budget / packing strategies and their packers, the split over
data-parallel replicas, and the FLOPs a micro-batch computes."""
