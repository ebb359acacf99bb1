"""Model ids as vLLM takes them: `jaxsched serve Qwen/Qwen3-0.6B`, `LLM(model="org/name", revision=...)`.

A model that names an existing folder or .gguf file is used as it is. Anything else is a Hugging
Face Hub repository id, resolved by huggingface_hub into a folder of its cache: the library keeps
the cache layout, the token (HF_TOKEN, or the one `hf auth login` saved), the endpoint and the
cache folder (HF_HOME, HF_HUB_CACHE), so a model downloaded by any Hugging Face tool is found here
and the other way round. Only what the engine reads is downloaded: configs, safetensors weights
(not the consolidated or original/ copies some repositories carry beside them) and tokenizer files.
With HF_HUB_OFFLINE set the cache alone is asked; without it, a hub that cannot be reached falls
back to the cache too (huggingface_hub's own rule).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from jaxsched import envs

if TYPE_CHECKING:
    from jaxsched.config import EngineArgs

# the files of a repository the engine reads (loader.py, tokenizer.py)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
IGNORE_PATTERNS = ["consolidated*.safetensors", "original/*"]


def is_local(model: str) -> bool:
    """Whether `model` names a path rather than a Hub id: it exists, or it is written as a path."""
    return os.path.exists(model) or model.startswith(("/", "./", "../", "~")) or model.endswith(".gguf") \
        or model.count("/") > 1


def resolve(model: str, revision: str | None = None, download_dir: str | None = None, field: str = "model") -> str:
    """The local path of `model`: itself when it is a path, else the Hub repository's snapshot in
    the cache (downloaded first unless offline). ValueError naming `field` when it cannot be had."""
    if is_local(model):
        if not os.path.exists(os.path.expanduser(model)):
            raise ValueError(f"{field} {model!r}: no such file or folder; pass a Hugging Face model folder, a "
                             ".gguf file or a Hub id such as 'Qwen/Qwen3-0.6B'")
        if revision is not None:
            raise ValueError(f"revision {revision!r} was given for the local {field} {model!r}: a revision "
                             "picks a Hub repository's version; drop it, or pass a Hub id")
        return os.path.expanduser(model)
    import huggingface_hub
    from huggingface_hub import errors

    offline = envs.hf_hub_offline()
    cache = download_dir or huggingface_hub.constants.HF_HUB_CACHE
    where = f"{model!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        huggingface_hub.utils.validate_repo_id(model)
        return huggingface_hub.snapshot_download(model, revision=revision, cache_dir=download_dir,
                                                 allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
                                                 local_files_only=offline)
    except errors.HFValidationError as e:
        raise ValueError(f"{field} {model!r} is neither an existing file or folder nor a Hugging Face Hub id "
                         f"('org/name'): {e}") from None
    except errors.GatedRepoError:
        raise ValueError(f"{field} {where} is gated on the Hugging Face Hub: accept its terms on the hub and "
                         "set HF_TOKEN (or run `hf auth login`)") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(f"{field} {where}: no such repository on the Hugging Face Hub, or it is private (set "
                         "HF_TOKEN to a token that can read it)") from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"{field} {where}: the repository has no such revision; pass a branch, tag or "
                         "commit it has") from None
    except errors.LocalEntryNotFoundError:
        why = f"{envs.HF_HUB_OFFLINE} is set" if offline else "the Hugging Face Hub could not be reached"
        raise ValueError(f"{field} {where} is not in the Hugging Face cache at {cache} and {why}: download it "
                         f"where the hub can be reached (`hf download {model}`), point --download-dir (or "
                         "HF_HUB_CACHE) at a cache that holds it, or pass a local folder") from None


def local_args(args: EngineArgs) -> EngineArgs:
    """`args` with its model, tokenizer and draft model (speculative_config) as local paths (Hub ids
    resolved; the demo model, None, stays None) and the revisions they were resolved at spent, so
    that resolving again is a no-op."""
    spec = args.speculative_config
    if spec is not None and spec.model is not None:
        draft = resolve(spec.model, None, args.download_dir, field="speculative_config.model")
        if draft != spec.model:
            args = dataclasses.replace(args, speculative_config=dataclasses.replace(spec, model=draft))
    if args.model is None and args.tokenizer is None:
        return args
    model = resolve(args.model, args.revision, args.download_dir) if args.model is not None else None
    tokenizer = args.tokenizer
    if tokenizer is not None:
        tokenizer = resolve(tokenizer, args.tokenizer_revision, args.download_dir, field="tokenizer")
    elif args.tokenizer_revision is not None:
        raise ValueError("tokenizer_revision was given without a tokenizer: the model's own tokenizer is read "
                         "at the model's revision; pass --tokenizer too, or drop it")
    return dataclasses.replace(args, model=model, tokenizer=tokenizer, revision=None, tokenizer_revision=None)
