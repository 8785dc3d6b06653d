"""C++ kernels for the XLA CPU backend, through the XLA FFI: the shared builder (`build`),
the parallel loop on XLA's pool (parallel_for.h) and the oneDNN projections (`matmul`).
Nothing here imports from the rest of jaxserve: attention and models call down into it."""
