"""Keep credentials out of everything a run writes or prints.

A config can pull values from the environment (``${oc.env:NAME}``), and users
put tokens in configs by mistake. :func:`redact` returns a copy of a config
(nested dicts and lists) in which

- a value under a key that names a credential (``api_key``, ``secret``,
  ``password``, ``credential``, ``token``, ``access_token``, ``hf_token``, ...,
  any case, as part of the key; not ``class_token``) is replaced by ``<redacted>``;
- any string containing the value of a credential-like environment variable
  (``WANDB_API_KEY``, ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ... : names
  containing KEY, TOKEN, SECRET, PASSWORD, PASSWD or CREDENTIAL, values of at
  least 8 characters) has it replaced by ``<redacted:$NAME>``.

A run (``suite/compose.py``) applies it to the saved ``resolved_config.yaml`` (which is what the loggers
record) and Hydra's ``.hydra/*.yaml`` files, and ``suite.checkpoint_io`` to the hyper-parameters in checkpoints;
the W&B logger starts its run under :func:`scrubbed_argv`, since wandb records
the command line.
The data module is built from the unredacted config, so a dataset option that
needs a credential still gets it.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from contextlib import contextmanager

# Not every "token" is a credential (model.class_token): only the usual credential names.
SECRET_KEY = re.compile(r"api_?key|secret|passw(?:or)?d|credential|(?:access|auth|api|bearer|refresh|hf|github|gh|"
                        r"wandb)_?token|(?<![a-z_])token(?![a-z_])", re.IGNORECASE)
SECRET_ENV = re.compile(r"KEY|TOKEN|SECRET|PASSW(OR)?D|CREDENTIAL", re.IGNORECASE)
MIN_SECRET_LEN = 8


def secret_values(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{value: NAME}`` for credential-like environment variables, longest values first."""
    environ = os.environ if environ is None else environ
    found = {v: k for k, v in environ.items() if SECRET_ENV.search(k) and len(v) >= MIN_SECRET_LEN}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def redact_text(text: str, secrets: Mapping[str, str] | None = None) -> str:
    secrets = secret_values() if secrets is None else secrets
    for value, name in secrets.items():
        if value in text:
            text = text.replace(value, f"<redacted:${name}>")
    return text


def redact(config, secrets: Mapping[str, str] | None = None, key: str | None = None):
    """A copy of ``config`` (dicts, lists, scalars) with credentials replaced; see the module docstring."""
    secrets = secret_values() if secrets is None else secrets
    if key is not None and SECRET_KEY.search(str(key)) and config is not None and not isinstance(config, Mapping):
        return "<redacted>"
    if isinstance(config, Mapping):
        return {k: redact(v, secrets, k) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(redact(v, secrets) for v in config)
    if isinstance(config, str):
        return redact_text(config, secrets)
    return config


def redact_file(path, secrets: Mapping[str, str] | None = None) -> None:
    """Rewrite a text file (Hydra's .hydra/*.yaml) with credential values and ``key: value`` secrets replaced."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError:
        return
    new = redact_text(text, secrets)
    # `api_key: abc`, `+logger.api_key=abc` (overrides.yaml): the value after a secret-named key.
    new = re.sub(rf"(\b[\w.+~]*(?:{SECRET_KEY.pattern})[\w.]*\s*[:=]\s*)(?!<redacted)([^\s'\"#,\]}}]+)",
                 r"\1<redacted>", new, flags=re.IGNORECASE)
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)


def redact_override(arg: str, secrets: Mapping[str, str] | None = None) -> str:
    """One command-line argument: ``key=value`` with a credential-named key -> ``key=<redacted>``; secret values
    from the environment replaced anywhere."""
    key, sep, _ = arg.partition("=")
    if sep and SECRET_KEY.search(key.split(".")[-1]):
        return f"{key}=<redacted>"
    return redact_text(arg, secrets)


@contextmanager
def scrubbed_argv():
    """``sys.argv`` with credentials redacted for the duration (wandb.init records the command line);
    restored afterwards, since Lightning re-runs the real command line for DDP processes."""
    saved = sys.argv
    sys.argv = [saved[0], *(redact_override(a) for a in saved[1:])]
    try:
        yield
    finally:
        sys.argv = saved
