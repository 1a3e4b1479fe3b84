"""The multi-job trainer: every job's LoRA adapter over one frozen base model, the GRPO maths, the
packed micro-batches and fused elementwise kernels, and the trainer's side of the adapter hand-off."""
