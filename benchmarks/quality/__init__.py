"""Quality benchmarks: learning curves, curation, GRESO, prompt probes, the verifier on real data."""
