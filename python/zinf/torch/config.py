"""What zinf.torch reads of a DeepSpeed config itself, before (or besides) the engine's parse:
the config as a dict, its ZeRO stage, and the world's collective timeout
(zinf.collective_timeout_seconds)."""

import json
import os

from zinf import _zinf


def _config_dict(config):
    """A config path or dict as a dict (None when it cannot be read here: the optimizer's
    parse reports it)."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
    return config if isinstance(config, dict) else None


def _stage_of(config):
    """The config's zero_optimization.stage (None when it cannot be read here)."""
    config = _config_dict(config)
    if config is None:
        return None
    zero = config.get("zero_optimization", {})
    return zero.get("stage", 0) if isinstance(zero, dict) else None


def _set_wait_timeout(config):
    """The world's collectives (zinf.torch's before an optimizer owns the parameters: gathers
    from the shards, gathered(modify=True), the constructor's agreements) wait for the other
    ranks at most the config's zinf.collective_timeout_seconds (default 600), as an engine's
    do; a config that does not set it leaves the current value."""
    config = _config_dict(config)
    section = config.get("zinf") if config is not None else None
    seconds = section.get("collective_timeout_seconds") if isinstance(section, dict) else None
    if (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
            and 1 <= seconds <= 604800):
        _zinf.set_wait_timeout(float(seconds))
