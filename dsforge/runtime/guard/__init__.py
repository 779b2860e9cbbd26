"""Guarding a rank's process: failure records made from exceptions, out-of-memory and build
failures, the step watchdog, stop requests and time limits, the supervisor. Imports nothing
else of runtime/."""
