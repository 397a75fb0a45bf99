"""Compute backends of the runtime (issue #17): ``cuda_kernels`` holds the Triton kernels on GGUF blocks."""
