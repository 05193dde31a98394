"""One file per op: the torch reference that defines it, its Triton kernel when it has one, and a
dispatch function that picks the kernel on CUDA and the reference elsewhere.

Models call the dispatch functions only; tests compare kernels with the references."""
