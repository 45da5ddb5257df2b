"""Search-v0: answer questions by searching a corpus (Search-R1 style retrieval QA)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from agent_gym import data
from agent_gym.actions.protocols import TagProtocol, ToolCallProtocol, choose_protocol
from agent_gym.actions.tools import ToolCallError, ToolSpec, parse_tag_call
from agent_gym.env.base import BackendFailure, Opening, OutcomeEnv, Task, Transition
from agent_gym.paths import cache_root
from agent_gym.rewards import exact_match, f1_score
from agent_gym.search import (
    BACKENDS,
    CachedBackend,
    Passage,
    ResponseCache,
    SearchError,
    open_backend,
    world_large,
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
PROTOCOLS = (ToolCallProtocol(SEARCH_TOOL, "query"), TagProtocol("search", "information", "query"))
PROMPT = (
    "Answer the given question. You can reason first, and look things up in an encyclopedia "
    "at most {n} times, one search per message. {how} When you know the answer, end your "
    "message with <answer> short answer </answer>, without explanation."
)
# FlashRAG's copies of NQ and HotpotQA, the data Search-R1 trains and evaluates on.
HUB_SETS = {"nq": ("nq", "test"), "hotpotqa": ("hotpotqa", "dev")}
HUB_NAME = "RUC-NLPIR/FlashRAG_datasets"
# Greedy to the end of the line, stripped afterwards: a lazy group followed by \s*$ rescans
# the rest of the line from every position (quadratic on a line of spaces).
_ANSWER_LINE = re.compile(r"^[ \t*#]*(?:final[ \t]+)?answer[ \t]*:(.*)$", re.I | re.M)
MAX_QUERY_CHARS = 500
# The splits a local data set names in its rows' ``split`` field, and the whole set.
SPLITS = ("train", "test")
ALL = "all"


class SearchEnv(OutcomeEnv):
    """Multi-turn retrieval QA: search, read passages, answer.

    Observation: the question at reset; after a search, the top passages ("Doc i (Title:
    ...) text", each capped) and the searches left, wrapped by the protocol; after an
    answer, what was read as the answer. Backend failures (server down, retries exhausted)
    come back as an error observation and the episode goes on; the failure is recorded in
    the state, so a restore reproduces it at that step rather than asking a backend that may
    have recovered (``TextEnv._outside``). Successful searches replay from the response
    cache. Passages that print ``</information>`` cannot close their block (the tag protocol
    neutralises its own tags in the output). A closed env refuses to step.
    Action: the assistant's reply. With ``protocol="tool"`` a search is a ``search`` tool
    call (Hermes JSON or Qwen3 XML), answered by a ``tool`` message; with
    ``protocol="tag"`` it is Search-R1's ``<search>query</search>``, answered by a ``user``
    message in ``<information>`` tags. The answer is ``<answer>...</answer>`` ending the
    message or a last line ``Answer: ...``, in either protocol.
    Reward: ``reward_correct`` when the answer exactly matches a gold answer after SQuAD
    normalisation, else ``reward_incorrect``, which is also the last step's reward when the
    turns run out without an answer. An invalid step (malformed call, neither search nor
    answer, empty or over-long query, search budget spent) earns ``-invalid_penalty``; a
    backend failure is not the agent's fault and costs nothing.
    Episode end: terminated by an answer; truncated after ``max_turns`` replies.
    Info: after a search ``query`` and ``passage_ids`` (or ``search_error``); after an
    answer ``answer``, ``em``, token ``f1`` and ``searches``; ``no_answer`` on a truncated
    last step.

    Args:
        data_path: a JSONL/parquet file with ``question`` and ``golden_answers`` (FlashRAG),
            ``answers`` or ``answer``; overrides ``dataset``.
        dataset: ``"bundled"`` (the original set, answerable from the bundled corpus),
            ``"world-large"`` (an original set of 1000 train and 250 test questions over a
            4120-passage corpus, generated into the cache on first use and checked against
            its recorded digests: `agent_gym.search.world_large`; the ``bm25`` backend then
            indexes its corpus unless ``corpus`` or ``index_dir`` says otherwise), or
            ``"nq"`` / ``"hotpotqa"`` from the hub (FlashRAG's copies, as Search-R1 uses).
            Pair those with a Wikipedia-scale backend.
        split: for the bundled set and ``data_path`` files, ``"train"`` or ``"test"`` keeps
            the records whose own ``split`` field says so, ``"all"`` (the default) keeps
            every record. The bundled set holds its split in its data: 56 train and 18 test
            questions, every fourth held out (``agent_gym.search.world``), so each question
            template is on both sides and a model trained on ``train`` meets only unseen
            entities on ``test``. The default is ``all`` so that task indices, seeds and
            every figure measured before the split existed stay what they were; train on
            ``split="train"`` and measure on ``split="test"``. ``world-large`` splits the
            same way, by its records' ``split`` field, and its two sides share no entity
            at all. For ``nq`` / ``hotpotqa`` it is the hub split (default test / dev).
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
        reward_correct, reward_incorrect: the two outcome rewards.
        invalid_penalty: subtracted on every invalid step (0 by default, as in Search-R1's
            EM-only reward).
        timeout, max_retries: per request to the ``http`` and ``wikipedia`` backends.

    Trust: the backend and where it lives (``backend``, ``url``, ``corpus``, ``index_dir``,
    ``cache``), its time budget (``timeout``, ``max_retries``) and the data sources
    (``data_path``, ``dataset``, ``split``) are host settings: a state never chooses them.
    """

    env_id = "agent_gym/Search-v0"
    # Network endpoints, host paths (the cache is written), time budgets: never a state's.
    host_settings = frozenset({
        "backend", "url", "corpus", "index_dir", "cache", "timeout", "max_retries",
        "data_path", "dataset", "split",
    })

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
        reward_correct: float = 1.0,
        reward_incorrect: float = 0.0,
        invalid_penalty: float = 0.0,
        timeout: float = 10.0,
        max_retries: int = 3,
        render_mode: str | None = None,
    ) -> None:
        self.protocol = choose_protocol(protocol, PROTOCOLS)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if topk < 1 or max_searches < 0 or passage_chars < 1:
            raise ValueError("need topk >= 1, max_searches >= 0 and passage_chars >= 1")
        super().__init__(
            load_tasks(data_path, dataset, split),
            max_turns=max_turns,
            reward_correct=reward_correct,
            reward_incorrect=reward_incorrect,
            invalid_penalty=invalid_penalty,
            max_obs_chars=max_obs_chars,
            render_mode=render_mode,
        )
        self.topk = topk
        self.max_searches = max_searches
        self.passage_chars = passage_chars
        if (backend == "bm25" and dataset == world_large.NAME and data_path is None
                and corpus is None and index_dir is None):
            corpus = str(world_large.ensure() / world_large.CORPUS_FILE)
        raw = open_backend(backend, corpus=corpus, index_dir=index_dir, url=url,
                           timeout=timeout, max_retries=max_retries)
        self.backend = CachedBackend(raw, _open_cache(cache, backend))
        self._searches = 0

    # ------------------------------------------------------------------ episode
    def _start(self, task: Task) -> Opening:
        self._searches = 0
        question = task.payload["question"]
        system = PROMPT.format(n=self.max_searches, how=self.protocol.instructions("search"))
        return Opening(
            observation=question,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            tools=self.protocol.tools,
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
        return [self.protocol.format(q) for q in queries] + [f"<answer>{answer}</answer>"]

    def _step(self, action: str) -> Transition:
        try:
            if action.rstrip().endswith("</answer>"):
                return self._answer(parse_tag_call(action, "answer") or "")
            query = self.protocol.parse(action)
        except ToolCallError as err:
            return self._invalid(f"Invalid action: {err}.")
        if query is not None:
            return self._search(query.strip())
        line = _ANSWER_LINE.findall(action)
        if line:
            return self._answer(line[-1])
        return self._invalid(
            f"No search and no answer found. {self.protocol.instructions('search')} To answer, "
            "end your message with <answer> ... </answer> or a line 'Answer: ...'."
        )

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
            passages = self._outside(lambda: self.backend.search([query], self.topk)[0],
                                     SearchError)
        except BackendFailure as err:
            # Not the agent's fault: no penalty, no search spent; the episode goes on.
            return self._observe(f"Search failed: {err.message}. You can search again or "
                                 "answer.", {"query": query, "search_error": err.message})
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
        """The answer to a parsed call, wrapped by the protocol (the base sanitises and
        caps it)."""
        return Transition(self.protocol.wrap(text), invalid=invalid,
                          role=self.protocol.reply_role, info=info)

    def _answer(self, answer: str) -> Transition:
        answer = answer.strip().strip("*").strip()  # "**Answer:** x" in markdown
        if not answer:
            return self._invalid("The answer is empty.")
        golds = list(self.task.payload["answers"])
        correct = exact_match(answer, golds)
        info = {"answer": answer, "em": correct, "f1": f1_score(answer, golds),
                "searches": self._searches}
        return Transition(f"Final answer: {answer}", self._outcome(correct), terminated=True,
                          role="user", info=info)

    @staticmethod
    def _invalid(message: str) -> Transition:
        """No call was executed, so the reply is a `user` message (a `tool` message must
        answer a call)."""
        return Transition(message, invalid=True, role="user")

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
    if data_path is None and dataset in HUB_SETS:
        config, default_split = HUB_SETS[dataset]
        records = data.load_hub(HUB_NAME, config, split or default_split)
        source = f"{HUB_NAME}/{config}"
    elif data_path is not None or dataset in ("bundled", world_large.NAME):
        if data_path is not None:
            records, source = data.load_records(data_path), data_path
        elif dataset == "bundled":
            records, source = data.bundled("search_qa"), "bundled search_qa"
        else:
            records = data.load_records(world_large.ensure() / world_large.QA_FILE)
            source = f"{world_large.NAME} search_qa"
        records = _in_split(records, split or ALL, source)
    else:
        raise data.DataError(f"dataset must be 'bundled', '{world_large.NAME}', 'nq' or "
                             f"'hotpotqa', got {dataset!r}")
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


def _in_split(records: list[dict[str, Any]], split: str, source: str) -> list[dict[str, Any]]:
    """The records of ``split`` by their own ``split`` field (``all``: every record, in
    file order, whether or not they carry one)."""
    if split == ALL:
        return records
    if split not in SPLITS:
        raise data.DataError(f"split must be one of {(*SPLITS, ALL)} for {source}, got {split!r}")
    if any("split" not in record for record in records):
        raise data.DataError(f"{source} has no 'split' field on every record: only "
                             "split='all' can read it")
    chosen = [record for record in records if record["split"] == split]
    if not chosen:
        raise data.DataError(f"{source} has no record in split {split!r}")
    return chosen


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
