"""The runtime that runs any task: composing a run, training and testing it, checkpoints, resume, guards,
loggers, redaction, validation, summaries, sweeps and reports. What is trained lives in ``tasks/``."""
