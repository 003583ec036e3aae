"""Speed benchmarks: step times, rollouts, levers, options, engines, grpo against TRL."""
