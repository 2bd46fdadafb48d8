"""Paged-KV kernels (Triton) beside their torch references; the op API is `sparrow.kernels.ops`."""
