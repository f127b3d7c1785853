"""Third-party noise silenced for every command and every build: lines that concern neither the
user nor the build, printed because a model's module imports them.

torchao (which transformers imports when it is installed) logs each optional CUDA extension it cannot
load (``Failed to load .../_C_mxfp8...so``) on every CPU host, and torch's pytree warns about
torchao's enum registrations. Both are logging records: their loggers are raised to ERROR, so a real
error still shows.
"""

from __future__ import annotations

import logging

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_third_party_warnings() -> None:
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
