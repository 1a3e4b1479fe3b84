"""The run's record: what a run writes as it goes and what is computed from it (JSONL metrics, the
timeline, the summary, throughput, compiles, GPU use, the code version)."""
