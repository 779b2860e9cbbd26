"""Calibration: `dsforge calibrate` times the cost model's terms on this machine (the only
package that runs layers for it: GEMMs, attention, the optimizer step, a layer's host floor),
and `dsforge refit` fits a profile from bench studies' cells (docs/search.md)."""
