"""Helpers shared by several unit test files (not collected: no test_ names here)."""
