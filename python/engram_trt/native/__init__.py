"""Bindings to native libraries: the project's kernel library (``libengram_trt_plugins.so``,
through ctypes: hash, gather, gate, host gather and its driver, attention, backbone and
cache kernels) and TensorRT / TensorRT-RTX (``trt_compat``, the one module that imports
either). Nothing here imports a module above it; every caller reaches the GPU through
these modules."""
