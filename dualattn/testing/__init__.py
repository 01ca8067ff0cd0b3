"""Test support that ships with the package: the independent float64 references (needs torch)."""
