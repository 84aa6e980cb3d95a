"""Running plans: the instruction executor core and the background workers that plan
iterations ahead of training."""
