"""Search-v0: answer questions by searching a corpus (Search-R1 style retrieval QA)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from agent_gym import data
from agent_gym.core import Opening, Task, TextEnv, Transition
from agent_gym.rewards import exact_match, f1_score
from agent_gym.search import (
    BACKENDS,
    CachedBackend,
    Passage,
    ResponseCache,
    SearchError,
    cache_root,
    open_backend,
)
from agent_gym.tools import (
    ToolCallError,
    ToolSpec,
    parse_tag_call,
    parse_tool_call,
    sanitize_tool_output,
)

SEARCH_TOOL = ToolSpec(
    name="search",
    description="Search the encyclopedia and return the most relevant passages for a query.",
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to look up"}},
        "required": ["query"],
        "additionalProperties": False,
    },
)
TOOL_PROMPT = (
    "Answer the question. You can look things up with the `search` tool, which returns "
    "encyclopedia passages; call it at most {n} times, one call per message. When you know "
    "the answer, end your message with a line `Answer: <short answer>`."
)
TAG_PROMPT = (
    "Answer the given question. You can reason first. To search, end your message with "
    "<search> query </search>; the results come back between <information> and "
    "</information>. You can search at most {n} times. When you know the answer, end your "
    "message with <answer> short answer </answer>, without explanation."
)
# FlashRAG's copies of NQ and HotpotQA, the data Search-R1 trains and evaluates on.
HUB_SETS = {"nq": ("nq", "test"), "hotpotqa": ("hotpotqa", "dev")}
HUB_NAME = "RUC-NLPIR/FlashRAG_datasets"
_ANSWER_LINE = re.compile(r"^[ \t*#]*(?:final\s+)?answer\s*:\s*(.*?)\s*$", re.I | re.M)
MAX_QUERY_CHARS = 500


class SearchEnv(TextEnv):
    """Multi-turn retrieval QA: search, read passages, answer.

    Observation: the question at reset; after a search, the top passages ("Doc i (Title:
    ...) text", each capped) and the searches left; after an answer, what was read as the
    answer. Backend failures (server down, retries exhausted) come back as an error
    observation and the episode goes on.
    Action: the assistant's reply. With ``protocol="tool"`` a search is a ``search`` tool
    call (Hermes JSON or Qwen3 XML); with ``protocol="tag"`` it is Search-R1's
    ``<search>query</search>``. The answer is ``<answer>...</answer>`` ending the message or
    a last line ``Answer: ...``, in either protocol.
    Reward: 1.0 when the answer exactly matches a gold answer after SQuAD normalisation,
    else 0.0; token F1 is in ``info["f1"]``. An invalid step (malformed call, neither
    search nor answer, search budget spent) earns ``-format_penalty``.
    Episode end: terminated by an answer; truncated after ``max_turns`` replies.

    Args:
        data_path: a JSONL/parquet file with ``question`` and ``golden_answers`` (FlashRAG),
            ``answers`` or ``answer``; overrides ``dataset``.
        dataset: ``"bundled"`` (the original set, answerable from the bundled corpus), or
            ``"nq"`` / ``"hotpotqa"`` from the hub (FlashRAG's copies, as Search-R1 uses),
            split ``split`` (default test / dev). Pair those with a Wikipedia-scale backend.
        backend: ``"bm25"`` (local index), ``"http"`` (a Search-R1 ``/retrieve`` server at
            ``url``) or ``"wikipedia"`` (MediaWiki API at ``url``, default en.wikipedia).
        corpus, index_dir: for ``bm25``: a JSONL corpus indexed lazily into the cache dir
            (default: the bundled corpus), or a prebuilt index directory.
        cache: ``"auto"`` (in memory for bm25; a SQLite file under the cache dir for live
            backends, so restores replay the same passages), ``"memory"``, ``"off"``, or a
            path to a SQLite file.
        protocol: ``"tool"`` (a function tool, schema in ``info["tools"]``) or ``"tag"``.
        topk, passage_chars, max_obs_chars: passages per search, characters per passage,
            characters per observation.
        max_searches, max_turns: the search and reply budgets.
        format_penalty: subtracted on every invalid step (0 by default, as in Search-R1's
            EM-only reward).
        timeout, max_retries: per request to the ``http`` and ``wikipedia`` backends.
    """

    env_id = "agent_gym/Search-v0"

    def __init__(
        self,
        data_path: str | None = None,
        dataset: str = "bundled",
        split: str | None = None,
        backend: str = "bm25",
        corpus: str | None = None,
        index_dir: str | None = None,
        url: str | None = None,
        cache: str = "auto",
        protocol: str = "tool",
        topk: int = 3,
        max_searches: int = 4,
        max_turns: int = 6,
        passage_chars: int = 600,
        max_obs_chars: int = 4000,
        format_penalty: float = 0.0,
        timeout: float = 10.0,
        max_retries: int = 3,
        render_mode: str | None = None,
    ) -> None:
        if protocol not in ("tool", "tag"):
            raise ValueError(f"protocol must be 'tool' or 'tag', got {protocol!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if topk < 1 or max_searches < 0 or passage_chars < 1 or max_obs_chars < 100:
            raise ValueError("need topk >= 1, max_searches >= 0, passage_chars >= 1 and "
                             "max_obs_chars >= 100")
        super().__init__(
            load_tasks(data_path, dataset, split),
            max_turns=max_turns,
            render_mode=render_mode,
        )
        self.protocol = protocol
        self.topk = topk
        self.max_searches = max_searches
        self.passage_chars = passage_chars
        self.max_obs_chars = max_obs_chars
        self.format_penalty = format_penalty
        raw = open_backend(backend, corpus=corpus, index_dir=index_dir, url=url,
                           timeout=timeout, max_retries=max_retries)
        self.backend = CachedBackend(raw, _open_cache(cache, backend))
        self._searches = 0

    # ------------------------------------------------------------------ episode
    def _start(self, task: Task) -> Opening:
        self._searches = 0
        prompt = TOOL_PROMPT if self.protocol == "tool" else TAG_PROMPT
        question = task.payload["question"]
        return Opening(
            observation=question,
            messages=[
                {"role": "system", "content": prompt.format(n=self.max_searches)},
                {"role": "user", "content": question},
            ],
            tools=[SEARCH_TOOL.openai_schema()] if self.protocol == "tool" else [],
            privileged={
                "answers": list(task.payload["answers"]),
                "gold_passage_ids": list(task.payload["supporting"]),
                "oracle_actions": self._oracle(task),
            },
        )

    def _oracle(self, task: Task) -> list[str]:
        """The scripted solution: search each supporting passage's title, then answer."""
        queries = task.payload["oracle_queries"][: self.max_searches]
        answer = task.payload["answers"][0]
        if self.protocol == "tag":
            return [f"<search>{q}</search>" for q in queries] + [f"<answer>{answer}</answer>"]
        calls = [json.dumps({"name": "search", "arguments": {"query": q}}, ensure_ascii=False)
                 for q in queries]
        return [f"<tool_call>{c}</tool_call>" for c in calls] + [f"Answer: {answer}"]

    def _step(self, action: str) -> Transition:
        try:
            if action.rstrip().endswith("</answer>"):
                return self._answer(parse_tag_call(action, "answer") or "")
            query = self._parse_search(action)
        except ToolCallError as err:
            return self._invalid(f"Invalid action: {err}.")
        if query is not None:
            return self._search(query)
        line = _ANSWER_LINE.findall(action)
        if line:
            return self._answer(line[-1])
        how = ("call the search tool" if self.protocol == "tool"
               else "end your message with <search> query </search>")
        return self._invalid(
            f"No search and no answer found. To search, {how}. To answer, end your message "
            "with <answer> ... </answer> or a line 'Answer: ...'."
        )

    def _parse_search(self, action: str) -> str | None:
        if self.protocol == "tag":
            return parse_tag_call(action, "search")
        call = parse_tool_call(action, [SEARCH_TOOL])
        return None if call is None else str(call.arguments["query"]).strip()

    def _search(self, query: str) -> Transition:
        """Run one search; answers to a parsed call are `tool` messages, even refusals."""
        if not query:
            return self._observe("Invalid search: the query is empty.", {}, invalid=True)
        if len(query) > MAX_QUERY_CHARS:
            return self._observe(f"Invalid search: keep the query under {MAX_QUERY_CHARS} "
                                 f"characters (it has {len(query)}).", {}, invalid=True)
        if self._searches >= self.max_searches:
            return self._observe(f"No searches left (the budget is {self.max_searches}); "
                                 "give your answer now.", {}, invalid=True)
        try:
            passages = self.backend.search([query], self.topk)[0]
        except SearchError as err:
            # Not the agent's fault: no penalty, no search spent; the episode goes on.
            return self._observe(f"Search failed: {err}. You can search again or answer.",
                                 {"query": query, "search_error": str(err)})
        self._searches += 1
        left = self.max_searches - self._searches
        body = self._format(passages) if passages else "No passage matches this query."
        return self._observe(f"{body}\n({left} search{'es' if left != 1 else ''} left)",
                             {"query": query, "passage_ids": [p.id for p in passages]})

    def _format(self, passages: list[Passage]) -> str:
        """Search-R1's "Doc i (Title: ...)" layout; each text capped so all fit the budget."""
        share = max(self.max_obs_chars // max(len(passages), 1) - 40, 40)
        cap = min(self.passage_chars, share)
        docs = []
        for i, p in enumerate(passages, 1):
            text = " ".join(p.text.split())
            if len(text) > cap:
                text = text[:cap].rsplit(" ", 1)[0] + " ..."
            docs.append(f"Doc {i} (Title: {p.title}) {text}" if p.title else f"Doc {i} {text}")
        return "\n".join(docs)

    def _observe(self, text: str, info: dict[str, Any], invalid: bool = False) -> Transition:
        text = sanitize_tool_output(text, self.max_obs_chars)
        reward = (-self.format_penalty or 0.0) if invalid else 0.0
        if self.protocol == "tag":
            return Transition(f"<information>{text}</information>", reward, invalid=invalid,
                              role="user", info=info)
        return Transition(text, reward, invalid=invalid, role="tool", info=info)

    def _answer(self, answer: str) -> Transition:
        answer = answer.strip().strip("*").strip()  # "**Answer:** x" in markdown
        if not answer:
            return self._invalid("The answer is empty.")
        golds = list(self.task.payload["answers"])
        correct = exact_match(answer, golds)
        info = {"answer": answer, "em": correct, "f1": f1_score(answer, golds),
                "searches": self._searches}
        return Transition(f"Final answer: {answer}", 1.0 if correct else 0.0, terminated=True,
                          role="user", info=info)

    def _invalid(self, message: str) -> Transition:
        """No call was executed, so the reply is a `user` message (a `tool` message must
        answer a call)."""
        return Transition(message, -self.format_penalty or 0.0, invalid=True, role="user")

    def _close(self) -> None:
        self.backend.close()


def _open_cache(setting: str, backend: str) -> ResponseCache:
    """`auto` persists responses of live backends (their answers can change) and keeps a
    local index's in memory (it is deterministic); `off` is a zero-size memory cache."""
    if setting == "auto":
        path = None if backend == "bm25" else cache_root() / "search" / "responses.sqlite"
        return ResponseCache(path)
    if setting == "memory":
        return ResponseCache()
    if setting == "off":
        return ResponseCache(max_memory=0)
    return ResponseCache(Path(setting))


def load_tasks(data_path: str | None, dataset: str, split: str | None) -> list[Task]:
    if data_path is not None:
        records, source = data.load_records(data_path), data_path
    elif dataset in HUB_SETS:
        config, default_split = HUB_SETS[dataset]
        records = data.load_hub(HUB_NAME, config, split or default_split)
        source = f"{HUB_NAME}/{config}"
    elif dataset == "bundled":
        if split is not None:
            raise data.DataError("the bundled set has a single split; pass dataset='nq' or "
                                 "'hotpotqa' to choose a split")
        records, source = data.bundled("search_qa"), "bundled search_qa"
    else:
        raise data.DataError(f"dataset must be 'bundled', 'nq' or 'hotpotqa', got {dataset!r}")
    data.require_fields(records, ("question",), source)
    tasks = []
    for index, record in enumerate(records):
        answers = _golds(record)
        if not answers:
            raise data.DataError(
                f"{source}: record {index} has no gold answers (expected 'golden_answers', "
                "'answers', 'answer' or reward_model.ground_truth.target)"
            )
        task_id = str(record.get("id", f"{Path(source).stem}-{index}"))
        tasks.append(Task(task_id, {
            "question": str(record["question"]).strip(),
            "answers": answers,
            "supporting": [str(s) for s in record.get("supporting") or []],
            "oracle_queries": [str(q) for q in record.get("oracle_queries") or []],
        }))
    return tasks


def _golds(record: dict[str, Any]) -> list[str]:
    """Gold answers from the layouts in use: FlashRAG, plain, HotpotQA, Search-R1 parquet."""
    value: Any = None
    for key in ("golden_answers", "answers", "answer"):
        if record.get(key) is not None:
            value = record[key]
            break
    else:
        reward_model = record.get("reward_model")
        if isinstance(reward_model, dict):
            value = (reward_model.get("ground_truth") or {}).get("target")
    if isinstance(value, str):
        value = [value]
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    return [str(v) for v in value or [] if str(v).strip()]
