"""kvpush backend for NVIDIA GPUs: vLLM's CUDA KV caches pushed GPU to GPU over NIXL.

Importing this package imports neither torch nor CUDA: vLLM forks workers
after loading plugins, and a CUDA context created in the parent breaks them.
torch is imported when a ``CudaBackend`` is constructed.
"""

from kvpush_cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
