"""Guarding a rank's process and its training: failure records made from exceptions,
out-of-memory and build failures, the step watchdog, stop requests and time limits, the
supervisor, the non-finite guard and loss-spike check (health.py), the numeric drills. Imports
nothing else of runtime/."""
