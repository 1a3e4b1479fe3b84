"""The rollout engine: one vLLM engine serving every job's adapter, its client in this process or
in one of its own, and the engine's side of the adapter hand-off (the vLLM worker extension apart)."""
