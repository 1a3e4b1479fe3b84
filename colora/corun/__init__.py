"""The co-runner: the trainer's thread and the engine's thread, what they hand each other, the
jobs' groups and their rollouts."""
