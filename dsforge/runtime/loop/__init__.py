"""The training loop and its measurements: the trainer, one step, data, metrics, the step
breakdown, tracking and the profiler. May import runtime/checkpoint, runtime/build and
runtime/guard."""
