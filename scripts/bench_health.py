"""How long GET /health takes while the server tokenizes a large prompt (POST /tokenize), against a
running `jaxsched serve`: tokenization runs on worker threads, so the event loop should answer in
milliseconds meanwhile (the target is under 100 ms).

Prints one JSON line: the prompt's size, its token count and tokenize time, and the count, median
and maximum of the /health round trips made while it was being tokenized.

    make serve &                                  # or: jaxsched serve [MODEL] ...
    python scripts/bench_health.py                # 1 MiB prompt, http://127.0.0.1:8000
    python scripts/bench_health.py --mib 4 --url http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--mib", type=float, default=1.0, help="prompt size in MiB (default 1)")
    args = ap.parse_args()
    sentence = "hello world, how are you today? "
    text = sentence * int(args.mib * 2**20 / len(sentence))
    done, result = threading.Event(), {}

    def tokenize() -> None:
        t0 = time.perf_counter()
        try:
            req = urllib.request.Request(args.url + "/tokenize", data=json.dumps({"prompt": text}).encode(),
                                         headers={"Content-Type": "application/json"})
            result["count"] = json.loads(urllib.request.urlopen(req, timeout=600).read())["count"]
            result["tokenize_s"] = time.perf_counter() - t0
        finally:
            done.set()

    threading.Thread(target=tokenize, daemon=True).start()
    lat = []
    while not done.is_set():
        t0 = time.perf_counter()
        urllib.request.urlopen(args.url + "/health", timeout=30).read()
        lat.append(time.perf_counter() - t0)
        time.sleep(0.01)
    print(json.dumps({"prompt_bytes": len(text), "tokens": result.get("count"),
                      "tokenize_s": round(result.get("tokenize_s", float("nan")), 2), "health_calls": len(lat),
                      "health_ms_median": round(statistics.median(lat) * 1000, 1) if lat else None,
                      "health_ms_max": round(max(lat) * 1000, 1) if lat else None}))


if __name__ == "__main__":
    main()
