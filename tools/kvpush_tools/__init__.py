"""kvpush's tooling, shipped apart from the product: benchmarks, the demo and the GPU benchmark.

``kvpush bench ...`` and ``kvpush demo`` dispatch here when this distribution is installed.
"""
