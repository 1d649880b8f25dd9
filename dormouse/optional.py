"""Optional packages (the extras of pyproject.toml): one clear error when a
feature that needs one is asked for and the package is not installed."""

from __future__ import annotations

import importlib.util

from dormouse.errors import ConfigError


def require_tensorboard() -> None:
    """Raise one clear error when tensorboard is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "--tensorboard needs the tensorboard package, which is not installed: "
            "pip install 'dormouse[tracking]' (or pip install tensorboard), or drop --tensorboard"
        )
