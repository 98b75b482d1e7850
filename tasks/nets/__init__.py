"""Networks trained by the task modules; each builds its mixers from an ``attn`` config."""
