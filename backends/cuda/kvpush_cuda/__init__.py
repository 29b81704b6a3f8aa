"""kvpush CUDA backend (placeholder until the CUDA backend lands)."""
