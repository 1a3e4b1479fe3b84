"""colora's benchmarks and tuning tools, each a program that prints its figures and writes JSON and Markdown:

    colora bench kernels [--quick] [--only lora|add_to|logsoftmax|reduce|tune]   kernels.py (tune.py for tune)
    colora bench trainer [...]                                                    trainer.py: a whole trainer step
    colora bench engine CONFIG [...]                                              engine.py: the engine's step time
                                                      (engine_profile.py: its traces; engine_report.py: the report)
    colora bench trl CONFIG --job NAME [...]                                      trl_grpo.py: the peer baseline, TRL
    colora bench adapter-sync CONFIG [...]                                        adapter_sync.py: adapter export + load
    python -m colora.bench.compile_check [LABEL ...] [--tune]                     sm_90a compile report, no GPU

measure.py holds what the kernel benchmarks share (timers, the profiler's kernel sums, the LoRA problem).
"""
