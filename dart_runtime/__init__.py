"""dart_runtime: platform code under DART's decisions, pure torch: the few-row CPU product measured per machine
(`matmul`), CUDA graph capture and replay (`cuda_graph`), waiting for a device before reading a clock (`sync`)."""
