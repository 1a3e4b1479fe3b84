"""One run: its pre-flight checks, its MPS daemon, its checkpoints and run directory, its output,
evaluation and the runner that ties them together."""
