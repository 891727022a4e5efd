"""An unadopted script run with --plain whose set-up raises a ConfigError on rank 1 (a setting
the library refuses): deterministic, so a restart would raise it again."""

from __future__ import annotations

import os

from checkpointless.errors import ConfigError

if os.environ.get("RANK") == "1":
    raise ConfigError("plain_config_error.py: --bad-setting is refused; drop it")
