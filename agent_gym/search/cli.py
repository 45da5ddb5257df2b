"""`agent-gym search index|serve|query`: build a BM25 index, serve it over Search-R1's
`/retrieve` protocol, or query an index directory or a running server."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from agent_gym.search.bm25 import BM25Index
from agent_gym.search.client import RetrievalClient
from agent_gym.search.passages import CorpusError, SearchBackend, SearchError
from agent_gym.search.server import RetrievalServer

Command = Callable[[argparse.Namespace], int]


def _reporting(command: Command) -> Command:
    """Turn the expected failures (bad paths, bad corpus, unreachable server) into one
    line on stderr and exit status 2 instead of a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (OSError, CorpusError, SearchError, ValueError) as exc:
            print(f"agent-gym search {args.search_command}: error: {exc}", file=sys.stderr)
            return 2

    return run


def register(subparsers: Any) -> None:
    """Add the `search` command group to the top-level `agent-gym` parser."""
    search = subparsers.add_parser("search", help="build, serve and query BM25 search indexes")
    commands = search.add_subparsers(dest="search_command", required=True)

    index = commands.add_parser("index", help="index a JSONL corpus ({id, contents} or "
                                "{title, text} per line)")
    index.add_argument("corpus", help="corpus .jsonl or .jsonl.gz")
    index.add_argument("out_dir", help="directory to write the index to")
    index.add_argument("--force", action="store_true", help="replace an existing index")
    index.set_defaults(run=_reporting(_index))

    serve = commands.add_parser("serve", help="serve an index over POST /retrieve",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("index_dir", help="an index directory made by `agent-gym search index`")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback only "
                       "unless you give another)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--topk", type=int, default=3, help="topk when a request gives none")
    serve.set_defaults(run=_reporting(_serve))

    query = commands.add_parser("query", help="search an index directory or a server URL",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    query.add_argument("index", help="an index directory or http://host:port of a server")
    query.add_argument("text", nargs="+", help="one or more queries")
    query.add_argument("--topk", type=int, default=3, help="passages per query")
    query.add_argument("--json", action="store_true", help="print JSON lines")
    query.set_defaults(run=_reporting(_query))


def _index(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    index = BM25Index.build(args.corpus, args.out_dir, overwrite=args.force)
    print(f"indexed {index.num_docs} passages into {args.out_dir} "
          f"in {time.perf_counter() - start:.1f} s ({index.name})")
    index.close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    index = BM25Index(args.index_dir)
    server = RetrievalServer(index, args.host, args.port, default_topk=args.topk)
    print(f"serving {index.num_docs} passages ({index.name}) at {server.url}/retrieve",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        index.close()
    return 0


def _query(args: argparse.Namespace) -> int:
    backend: SearchBackend = (
        RetrievalClient(args.index) if args.index.startswith(("http://", "https://"))
        else BM25Index(args.index)
    )
    try:
        results = backend.search(args.text, args.topk)
    finally:
        backend.close()
    for text, passages in zip(args.text, results, strict=True):
        if args.json:
            print(json.dumps({"query": text, "result": [p.to_wire() for p in passages]},
                             ensure_ascii=False))
            continue
        print(f"# {text}")
        for rank, p in enumerate(passages, 1):
            print(f"{rank}. [{p.id}] {p.title} ({p.score:.2f})\n   {p.text}")
        if not passages:
            print("   (no passage shares a word with the query)")
    sys.stdout.flush()
    return 0
