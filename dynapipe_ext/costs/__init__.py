"""What a micro-batch costs: the model's layer spec, the analytic and profiled cost models
(time and memory per stage)."""
