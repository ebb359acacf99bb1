"""Write a draft model for speculative decoding made of a Llama-family model's first N layers (with
its embedding, final norm and lm_head), as a Hugging Face folder with the model's tokenizer: the
only draft with the demo model's tokenizer this machine can have (no hub). Untrained for early
exit, so its proposals are kept less often than a trained draft's; it exercises draft_model on a
real model (acceptance rate and speed in docs/PERFORMANCE.md).

  python scripts/truncated_draft.py OUT_FOLDER [--layers 8] [--model PATH (default: the demo model)]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from safetensors.numpy import save_file

from jaxsched.engine.tokenizer import load_tokenizer
from jaxsched.models.demo import demo_model_path
from jaxsched.models.loader import gguf_config, gguf_reader, load_hf_config, load_model_source

LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--model", default=None)
    ns = p.parse_args()
    path = ns.model or str(demo_model_path())
    cfg, get, kind = load_model_source(path)
    if cfg.architecture != "LlamaForCausalLM":
        raise SystemExit(f"{path}: a {cfg.architecture}; this script writes Llama-family drafts only")
    if not 1 <= ns.layers < cfg.num_layers:
        raise SystemExit(f"--layers must be in [1, {cfg.num_layers - 1}], got {ns.layers}")
    hf = gguf_config(gguf_reader(path)) if kind == "gguf" else load_hf_config(path)
    hf = {**hf, "num_hidden_layers": ns.layers, "dtype": "float32", "model_type": "llama"}
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not hf.get("tie_word_embeddings", False):
        names.append("lm_head.weight")
    names += [f"model.layers.{i}.{t}" for i in range(ns.layers) for t in LAYER_TENSORS]
    os.makedirs(ns.out, exist_ok=True)
    save_file({n: np.ascontiguousarray(get(n), np.float32) for n in names}, os.path.join(ns.out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(ns.out, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    load_tokenizer(path).save_pretrained(ns.out)
    print(f"wrote {ns.out}: the first {ns.layers} of {cfg.num_layers} layers of {path}")


if __name__ == "__main__":
    main()
