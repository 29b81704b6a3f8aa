"""Backend conformance suite."""
