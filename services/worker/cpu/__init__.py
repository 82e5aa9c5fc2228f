"""CPU-only code of the worker: C kernels built at first use and loaded through ctypes."""
