"""What the embedded Chroma server's door costs: small `collection.get` and `collection.query` calls
through the door (HOME/chroma/door.sock, a Unix socket, with the HOME's token: the only way in)
against the same calls straight to the server on its own TCP port, from a client inside the server's
network namespace (`nsenter`, root).

    .venv/bin/python benchmarks/chroma_proxy.py [--calls 1000] [--vectors 1000]

Prints, for each path and call, the median and p99 latency in ms and the calls per second, then the
added median latency of the proxy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from memory_pipelines.lib.infra import services
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.stores.chroma.client import http_client

DIMENSION = 384

CLIENT = r"""
import json, random, statistics, sys, time
import chromadb
from chromadb.config import Settings
url, headers, calls = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
if url.startswith("unix://"):
    from memory_pipelines.lib.stores.chroma.client import http_client
    client = http_client(url, headers=headers)
else:
    host, port = url.removeprefix("http://").split(":")
    settings = Settings(anonymized_telemetry=False)
    client = chromadb.HttpClient(host=host, port=int(port), headers=headers, settings=settings)
col = client.get_collection("bench")
count = col.count()
rng = random.Random(7)
vector = [rng.random() for _ in range(384)]
out = {}
for name, call in (
    ("get", lambda i: col.get(ids=[f"v{i % count}"], include=["metadatas"])),
    ("query", lambda i: col.query(query_embeddings=[vector], n_results=5, include=["distances"])),
):
    for i in range(50):
        call(i)
    times = []
    started = time.perf_counter()
    for i in range(calls):
        t = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - started
    times.sort()
    out[name] = {"median_ms": 1000 * statistics.median(times), "p99_ms": 1000 * times[int(0.99 * len(times))],
                 "per_s": calls / total}
print(json.dumps(out))
"""


def run_client(prefix: list[str], url: str, headers: dict[str, str], calls: int) -> dict[str, dict[str, float]]:
    """CLIENT's timings, run with `prefix` (empty, or an nsenter into the server's namespace)."""
    done = subprocess.run(
        [*prefix, sys.executable, "-c", CLIENT, url, json.dumps(headers), str(calls)],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--vectors", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each path; the best is kept")
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("nsenter") is None:
        sys.exit("needs root and nsenter: the direct client runs inside the server's network namespace")
    home = Path(tempfile.mkdtemp(prefix="mp-bench-chroma-proxy-"))
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    try:
        url = services.ensure_chroma(settings)
        state = services.chroma_state(settings)
        assert state is not None
        args_of_server = Path(f"/proc/{state['pid']}/cmdline").read_bytes().split(b"\0")
        inner = int(args_of_server[args_of_server.index(b"--port") + 1])
        import numpy as np

        client = http_client(url, headers=services.chroma_headers(url))
        col = client.get_or_create_collection("bench", metadata={"hnsw:space": "cosine"})
        vectors = np.random.default_rng(1).random((args.vectors, DIMENSION)).astype("float32")
        col.add(
            ids=[f"v{i}" for i in range(args.vectors)],
            embeddings=vectors,
            metadatas=[{"i": i} for i in range(args.vectors)],
        )
        ns = ["nsenter", f"--net=/proc/{state['pid']}/ns/net"]
        runs: dict[str, list[dict[str, dict[str, float]]]] = {"direct": [], "door": []}
        for _ in range(args.rounds):  # alternated: a busy moment of the machine hits both paths alike
            runs["direct"].append(run_client(ns, f"http://127.0.0.1:{inner}", {}, args.calls))
            runs["door"].append(run_client([], url, services.chroma_headers(url), args.calls))
        print(
            f"{args.calls} calls x {args.rounds} rounds, {args.vectors} vectors of {DIMENSION} dimensions, "
            f"isolation {state['isolation']}; best round of each"
        )
        for name in ("get", "query"):
            best = {
                label: min((r[name] for r in results), key=lambda r: r["median_ms"]) for label, results in runs.items()
            }
            for label, r in best.items():
                print(
                    f"{name:6s} {label:7s} median {r['median_ms']:6.3f} ms  p99 {r['p99_ms']:6.3f} ms  "
                    f"{r['per_s']:6.0f}/s"
                )
            print(f"{name:6s} added   median {best['door']['median_ms'] - best['direct']['median_ms']:+6.3f} ms")
    finally:
        services.stop_chroma(settings)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
