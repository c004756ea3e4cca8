"""The rounding back end: the custom ops and their C++ glue, the Triton kernels of the CUDA device, the pure-PyTorch reference, the inductor decompositions and the first-use self-check."""
