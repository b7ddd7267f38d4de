"""Compute kernels the layers call: plain-torch references here, CUDA kernels dispatched at run time."""
