"""The training loop and its measurements: the trainer, one step, data, metrics, the step
breakdown, tracking and the profiler. May import runtime/checkpoint, runtime/assemble and
runtime/guard."""
