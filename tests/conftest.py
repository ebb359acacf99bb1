"""Shared fixtures: the tiny tokenizer and tiny random checkpoints, built once per session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import tiny

# Every step the batch packer builds from the last step's buffers (steady decoding) is checked
# against packing it in full, in every engine the suite runs (jaxsched/runner/batch.py, VERIFY_ENV); set
# before any engine exists. Subprocesses the tests start inherit it.
os.environ.setdefault("JAXSCHED_VERIFY_PACK", "1")
# every byte-level detokenized token checked against the tokenizer's own windowed decode
# (jaxsched/engine/detokenizer.py, VERIFY_ENV)
os.environ.setdefault("JAXSCHED_VERIFY_DETOK", "1")

MODEL_KINDS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe",
               "mixtral")


# The user's cache, where the demo model is downloaded once and reused by later runs.
from jaxsched.envs import cache_dir

USER_CACHE = cache_dir()


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Keep compiled programs and converted tokenizers of a test run out of the user's cache."""
    old = os.environ.get("JAXSCHED_CACHE")
    os.environ["JAXSCHED_CACHE"] = str(tmp_path_factory.mktemp("jaxsched-cache"))
    yield
    if old is None:
        del os.environ["JAXSCHED_CACHE"]
    else:
        os.environ["JAXSCHED_CACHE"] = old


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("tokenizer"))
    tiny.build_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    """One tiny random checkpoint per architecture family, saved as a HF folder."""
    root = tmp_path_factory.mktemp("models")
    return {k: tiny.build_model(str(root / k), k, tokenizer_dir, seed=i) for i, k in enumerate(MODEL_KINDS)}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


def pytest_collection_modifyitems(config, items):
    """Modules with slow tests run first (a stable sort; tests keep their order inside a module).
    `make test-all` deals whole modules to its workers in collection order (`--dist loadfile`): a long
    module dealt last leaves the other worker idle until it ends (docs/PERFORMANCE.md, "Decisions in the code")."""
    slow = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in slow)
