"""Native sparse attention (NSA): the selected-branch kernels and their launch plan (Triton only)."""
