"""Search backend speed on a synthetic 100k-passage corpus, each figure beside its baseline.

- build: `BM25Index.build` (tokenize, index, passage store, save) vs bm25s alone
  (tokenize + index in memory, nothing written);
- load: mmap load vs loading the arrays into RAM, and the memory each costs;
- query: p50/p99 of one query and of a batch of 64, in process vs through the HTTP server
  (`RetrievalServer` + `RetrievalClient` on loopback);
- cache: a `CachedBackend` hit vs the index it fronts.

    python benchmarks/bench_search.py [--passages 100000] [--out benchmarks/results/search.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from harness import RESULTS, Result

from agent_gym.search import BM25Index, CachedBackend, ResponseCache, RetrievalClient
from agent_gym.search.bm25 import tokenize
from agent_gym.search.passages import SearchBackend, iter_corpus
from agent_gym.search.server import RetrievalServer

SYLLABLES = ["ka", "lo", "mir", "ten", "vo", "sar", "el", "dun", "bri", "os", "ra", "chel",
             "u", "fen", "gal", "ith", "mo", "ne", "tar", "quo", "zu", "ald", "ver", "pi"]


def synthetic_corpus(path: Path, passages: int, seed: int = 0) -> list[str]:
    """Write `passages` Search-R1 records with Zipf-distributed words (~80 per passage) and
    return query strings drawn from mid-frequency words of random passages."""
    rng = np.random.default_rng(seed)
    vocab_size = 60_000
    parts = rng.integers(0, len(SYLLABLES), size=(vocab_size, 3))
    words = np.array(["".join(SYLLABLES[i] for i in row[: 2 + r % 2])
                      for r, row in enumerate(parts)])
    weights = 1.0 / np.arange(1, vocab_size + 1) ** 1.07
    lengths = rng.integers(60, 101, size=passages)
    ids = rng.choice(vocab_size, size=int(lengths.sum()), p=weights / weights.sum())
    queries: list[str] = []
    with open(path, "w", encoding="utf-8") as out:
        start = 0
        for n, length in enumerate(lengths):
            doc = words[ids[start : start + length]]
            start += length
            title = " ".join(doc[:2]).title()
            out.write(json.dumps({"id": str(n), "contents": f'"{title}"\n{" ".join(doc)}'}) + "\n")
            if n % (passages // 400 or 1) == 0:
                picks = [w for w in doc if len(w) > 4][:4] or list(doc[:3])
                queries.append(" ".join(picks))
    return queries


def percentiles(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {"mean_ms": round(statistics.fmean(ms), 3), "p50_ms": round(statistics.median(ms), 3),
            "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3)}


def alternate(
    first: SearchBackend, second: SearchBackend, batches: list[list[str]]
) -> tuple[list[float], list[float]]:
    """Seconds per batch for each backend, calling them turn about."""
    times: tuple[list[float], list[float]] = ([], [])
    for batch in batches:
        for backend, out in zip((first, second), times, strict=True):
            start = time.perf_counter()
            backend.search(batch, 3)
            out.append(time.perf_counter() - start)
    return times


def concurrency(client: RetrievalClient, queries: list[str], workers: int) -> dict[str, float]:
    """Single-query throughput of `workers` threads sharing one client and server vs one."""
    def run(n: int) -> float:
        start = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda q: client.search([q], 3), queries))
        return len(queries) / (time.perf_counter() - start)

    one, many = run(1), run(workers)
    return {"workers": workers, "qps_one_client": round(one, 1),
            "qps_all_clients": round(many, 1), "ratio": round(many / one, 2)}


_RSS_PROBE = """
import json, sys, time
import bm25s
from agent_gym.search import BM25Index
def rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile")}
before = rss(); start = time.perf_counter()
index = BM25Index(sys.argv[1], mmap=sys.argv[2] == "mmap")
load = time.perf_counter() - start
index.search(sys.argv[3:], 3)
after = rss()
print(json.dumps({"load_s": load, "private_mb": after["RssAnon"] - before["RssAnon"],
                  "file_backed_mb": after["RssFile"] - before["RssFile"]}))
"""


def load_probe(index_dir: Path, mmap: bool, queries: list[str]) -> dict[str, float]:
    """Load time and memory growth (private vs file-backed, i.e. shared page cache) of
    loading an index and running `queries`, in a fresh process."""
    mode = "mmap" if mmap else "ram"
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(index_dir), mode, *queries],
                         check=True, capture_output=True, text=True).stdout
    return {k: round(v, 3) for k, v in json.loads(out).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS / "search.json")
    args = parser.parse_args()
    record = Result()
    results: dict[str, object] = record.figures
    results |= {"passages": args.passages, "bm25s_backend": "numpy"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "corpus.jsonl"
        start = time.perf_counter()
        queries = synthetic_corpus(corpus, args.passages)[: args.queries]
        results["corpus_generation_s"] = round(time.perf_counter() - start, 2)

        import bm25s

        start = time.perf_counter()
        texts = [f"{p.title} {p.text}" for p in iter_corpus(corpus)]
        bare = bm25s.BM25()
        bare.index(tokenize(texts, True), show_progress=False)
        bare_s = time.perf_counter() - start
        del bare, texts
        start = time.perf_counter()
        index = BM25Index.build(corpus, root / "index")
        build_s = time.perf_counter() - start
        results["build"] = {"agent_gym_s": round(build_s, 2), "bm25s_in_memory_s": round(bare_s, 2),
                            "ratio": round(build_s / bare_s, 2)}

        mmap_probe = load_probe(root / "index", True, queries[:64])
        ram_probe = load_probe(root / "index", False, queries[:64])
        results["index_on_disk_mb"] = round(
            sum(f.stat().st_size for f in (root / "index").iterdir()) / 2**20, 1)
        results["load"] = {"mmap": mmap_probe, "ram": ram_probe,
                           "private_mb_ratio_mmap_vs_ram": round(
                               mmap_probe["private_mb"] / max(ram_probe["private_mb"], 1e-9), 3)}

        batches = [queries[i : i + 64] for i in range(0, len(queries) - 63, 64)] or [queries]
        with RetrievalServer(index) as server:
            client = RetrievalClient(server.url, timeout=60.0)
            assert client.search(queries[:20], 3) == index.search(queries[:20], 3)  # warm-up
            # Alternate in-process and HTTP calls so load from other processes hits both alike.
            local_single, http_single = alternate(index, client, [[q] for q in queries])
            local_batch, http_batch = alternate(index, client, batches * 3)
            results["http_concurrency"] = concurrency(client, queries, workers=4)
            client.close()
        results["query_single"] = _compare(local_single, http_single)
        results["query_batch64"] = _compare(local_batch, http_batch)
        results["query_batch64"]["per_query_ms_in_process"] = round(
            statistics.median(local_batch) * 1000 / 64, 3)

        cached = CachedBackend(index, ResponseCache())
        cached.search(queries, 3)
        local, hits = alternate(index, cached, [[q] for q in queries])
        results["cache_hit"] = {**percentiles(hits), "ratio_vs_index_p50": round(
            statistics.median(hits) / statistics.median(local), 4)}
        index.close()

    record.write(args.out)
    _print_table(results)


def _compare(local: list[float], http: list[float]) -> dict[str, object]:
    a, b = percentiles(local), percentiles(http)
    return {"in_process": a, "http": b,
            "http_vs_in_process_p50": round(b["p50_ms"] / a["p50_ms"], 2),
            "http_vs_in_process_p99": round(b["p99_ms"] / a["p99_ms"], 2)}


def _print_table(r: dict) -> None:
    print(f"synthetic corpus: {r['passages']} passages ({r['bm25s_backend']}, {r['cpus']} cpus, "
          f"load average {r['load_average_at_start']} -> {r['load_average_at_end']})")
    b = r["build"]
    print(f"build            {b['agent_gym_s']:>8.2f} s   bm25s alone "
          f"{b['bm25s_in_memory_s']:.2f} s   ratio {b['ratio']}")
    m, ram = r["load"]["mmap"], r["load"]["ram"]
    print(f"load mmap        {m['load_s']:>8.3f} s   private +{m['private_mb']:.0f} MB, shared "
          f"+{m['file_backed_mb']:.0f} MB | in RAM {ram['load_s']:.3f} s private "
          f"+{ram['private_mb']:.0f} MB | index on disk {r['index_on_disk_mb']} MB")
    for name in ("query_single", "query_batch64"):
        q = r[name]
        print(f"{name:<16} p50 {q['in_process']['p50_ms']:>7.2f} ms  p99 "
              f"{q['in_process']['p99_ms']:>7.2f} ms | http p50 {q['http']['p50_ms']:.2f} ms "
              f"p99 {q['http']['p99_ms']:.2f} ms | ratio p50 {q['http_vs_in_process_p50']}")
    h = r["http_concurrency"]
    print(f"http 1 -> {h['workers']} clients {h['qps_one_client']:>6.0f} -> "
          f"{h['qps_all_clients']:.0f} queries/s   ratio {h['ratio']}")
    c = r["cache_hit"]
    print(f"cache hit        p50 {c['p50_ms']:>7.3f} ms  ({c['ratio_vs_index_p50']} x index)")


if __name__ == "__main__":
    main()
