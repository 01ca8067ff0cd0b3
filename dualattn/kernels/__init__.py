"""Framework-free Triton kernels and their launch plans (imports triton only).

One folder per algorithm; each kernel module is importable twice: compiled (the normal
import) and interpreted (see `_interpret.py`), built from the same source.
"""
