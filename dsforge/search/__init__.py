"""`dsforge plan --search`: enumerate, estimate and rank parallel layouts (docs/search.md)."""
