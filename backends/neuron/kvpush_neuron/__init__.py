"""kvpush Neuron backend (placeholder until the Neuron backend lands)."""
