import os

# Triton decides when a kernel is decorated whether it is interpreted, so the variable must be
# set before pagedkv's Triton module is first imported. Set TRITON_INTERPRET=0 explicitly to run
# tests/attention on a CUDA device instead.
os.environ.setdefault("TRITON_INTERPRET", "1")
