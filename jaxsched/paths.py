"""Where jaxsched keeps files between runs: the demo model, converted tokenizers, compiled programs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$JAXSCHED_CACHE, else $XDG_CACHE_HOME/jaxsched, else ~/.cache/jaxsched."""
    if os.environ.get("JAXSCHED_CACHE"):
        return Path(os.environ["JAXSCHED_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxsched"
