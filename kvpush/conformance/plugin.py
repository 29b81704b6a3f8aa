"""pytest plugin entry for the conformance suite (filled in by the conformance work)."""
