"""The CUDA backend's benchmark: push strategies and the layer-wise stand-in forward on a GPU."""
