"""The step-time cost model, torch-free: the cluster profile (profile.py), each step's terms
on it (step_time.py), and the terms fitted from measurements (fit.py, floor_fit.py). The search
ranks layouts with it, bench and the GPU kit store its predictions, and calibration
(dsforge/calibrate/) measures its terms (docs/search.md)."""
