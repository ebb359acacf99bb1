"""Hub model ids (jaxsched/models/hub.py), against a cache laid out as huggingface_hub lays it out
(models--org--name/{refs,snapshots}): no network here, so every lookup is the cache's."""

from __future__ import annotations

import os
import shutil

import pytest

from jaxsched import LLM, SamplingParams
from jaxsched.config import EngineArgs
from jaxsched.models import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def cache(llama_dir, tmp_path_factory):
    """A Hugging Face cache holding 'tiny-org/tiny-llama' at main (COMMIT) and at tag v0 (OLD), each
    snapshot a copy of the tiny llama folder."""
    root = tmp_path_factory.mktemp("hf_cache")
    repo = root / "models--tiny-org--tiny-llama"
    for sha in (COMMIT, OLD):
        shutil.copytree(llama_dir, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v0").write_text(OLD)
    return str(root)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_hub_id_resolves_to_its_cached_snapshot(cache, offline):
    assert hub.resolve("tiny-org/tiny-llama", download_dir=cache) == os.path.join(
        cache, "models--tiny-org--tiny-llama", "snapshots", COMMIT)
    assert hub.resolve("tiny-org/tiny-llama", "v0", cache).endswith(OLD)  # a tag
    assert hub.resolve("tiny-org/tiny-llama", OLD, cache).endswith(OLD)  # a commit


def test_a_hub_id_serves_the_same_tokens_as_its_folder(cache, offline, llama_dir):
    kw = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 8}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    by_id = LLM("tiny-org/tiny-llama", download_dir=cache, revision="v0", **kw)
    got = by_id.generate(["the cat sat on the"], params, use_tqdm=False)[0].outputs[0]
    want = LLM(llama_dir, **kw).generate(["the cat sat on the"], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == want.text


@pytest.mark.parametrize("kw,match", [
    ({"model": "tiny-org/missing"}, (r"model 'tiny-org/missing' is not in the Hugging Face cache at .*hf_cache.* "
                                     r"and HF_HUB_OFFLINE is set: download it .*`hf download tiny-org/missing`")),
    ({"model": "tiny-org/tiny-llama", "revision": "v9"},
     r"model 'tiny-org/tiny-llama' at revision 'v9' is not in the Hugging Face cache"),
    ({"model": "bad id!/x"}, r"model 'bad id!/x' is neither an existing file or folder nor a Hugging Face Hub id"),
    ({"model": "./no/such/folder"}, r"model './no/such/folder': no such file or folder"),
    ({"model": "tiny-org/tiny-llama", "tokenizer": "tiny-org/nope"}, r"tokenizer 'tiny-org/nope' is not in the"),
    ({"model": "tiny-org/tiny-llama", "tokenizer_revision": "v0"}, r"tokenizer_revision was given without a tokenizer"),
])
def test_what_cannot_be_had_says_what_and_where(cache, offline, kw, match):
    with pytest.raises(ValueError, match=match):
        hub.local_args(EngineArgs(download_dir=cache, **kw))


def test_a_local_model_is_used_as_it_is_and_resolving_twice_changes_nothing(cache, offline, llama_dir):
    args = EngineArgs(model=llama_dir)
    assert hub.local_args(args) == args
    once = hub.local_args(EngineArgs(model="tiny-org/tiny-llama", revision="v0", download_dir=cache))
    assert once.model.endswith(OLD) and once.revision is None and hub.local_args(once) == once
    with pytest.raises(ValueError, match="revision 'v0' was given for the local model"):
        hub.local_args(EngineArgs(model=llama_dir, revision="v0"))


def test_without_offline_an_unreachable_hub_falls_back_to_the_cache(cache, monkeypatch):
    """No HF_HUB_OFFLINE: huggingface_hub tries the hub (unreachable here: the endpoint is a closed
    local port) and then the cache; a repository it has not cached fails naming the hub."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    assert hub.resolve("tiny-org/tiny-llama", download_dir=cache).endswith(COMMIT)
    with pytest.raises(ValueError, match="the Hugging Face Hub could not be reached"):
        hub.resolve("tiny-org/missing", download_dir=cache)
