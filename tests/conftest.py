import os

# Triton kernels run on this CPU-only machine through the interpreter; set before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
