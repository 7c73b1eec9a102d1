"""What a training run is made of, below the `train` command: device and precision, checkpoints,
resume, the run folder and its card, progress and signals, optimizers and losses, the wsd plan
and the budget rule, data-parallel agreement, compilation, and the measurements beside a run
(memory, the load of other processes).
"""
