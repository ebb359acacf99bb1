"""How much an fp8 (e4m3) KV cache rounds the demo model's (or --model's) keys and values, with
the unscaled pool the engine keeps (scale 1.0, vLLM's default without calibrated k/v scales) and
with a calibrated per-layer scale (max |x| / 448, what a checkpoint's k_scale / v_scale would
give), against bfloat16's rounding: the RMS of the error over the RMS of the values, per layer,
for the 16 chat prompts of quantization_quality.py run through transformers' float32 model (torch
must be installed: `make test` installs it). docs/PERFORMANCE.md quotes it.

  python scripts/kv_fp8_error.py
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def relative_error(x: np.ndarray, rounded: np.ndarray) -> float:
    return float(np.sqrt(((rounded - x) ** 2).mean() / (x**2).mean()))


def main() -> None:
    import ml_dtypes
    import torch
    from quantization_quality import PROMPTS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxsched.models.demo import demo_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or .gguf file (default: the demo model)")
    path = ap.parse_args().model or str(demo_model_path())
    where = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
    folder = os.path.dirname(path) if where else path
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **where).eval()
    tok = AutoTokenizer.from_pretrained(folder, **where)
    keys: dict[int, list[np.ndarray]] = {}
    values: dict[int, list[np.ndarray]] = {}
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            cache = hf(ids, use_cache=True).past_key_values
        for i, layer in enumerate(cache.layers):
            keys.setdefault(i, []).append(layer.keys[0].numpy().reshape(-1))
            values.setdefault(i, []).append(layer.values[0].numpy().reshape(-1))

    def e4m3(x: np.ndarray, scale: float) -> np.ndarray:
        return np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale

    print("| layer | K: e4m3, scale 1 | K: e4m3, amax / 448 | K: bfloat16 | V: e4m3, scale 1 | V: e4m3, amax / 448 "
          "| V: bfloat16 |")
    print("|---|---|---|---|---|---|---|")
    for i, layer_keys in keys.items():
        row = []
        for x in (np.concatenate(layer_keys), np.concatenate(values[i])):
            row += [relative_error(x, e4m3(x, 1.0)), relative_error(x, e4m3(x, float(np.abs(x).max()) / 448)),
                    relative_error(x, x.astype(ml_dtypes.bfloat16).astype(np.float32))]
        print(f"| {i} | " + " | ".join(f"{100 * r:.2f} %" for r in row) + " |")


if __name__ == "__main__":
    main()
