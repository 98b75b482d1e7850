"""The runtime that runs any task: the command line before Hydra (cli), composing a run (compose), training and
testing it (train), checkpoints (checkpoints, checkpoint_io), resume, guards, loggers, redaction, validation
(validate, schema), summaries, sweeps and reports. What is trained lives in ``tasks/``."""
