"""rewind.kernels."""
