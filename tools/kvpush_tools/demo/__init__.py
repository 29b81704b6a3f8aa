"""Demo tooling: a tiny local model, a vLLM server launcher and the 1P1D demo."""
