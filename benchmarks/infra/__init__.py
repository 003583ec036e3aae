"""Infrastructure benchmarks: checkpoint cost, sandbox and reward-pool throughput, vLLM weight sync."""
