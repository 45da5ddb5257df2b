"""``agent-gym view``: one static HTML file to read eval runs in a browser, from disk.

Everything is in the file (CSS, a few lines of JS, inline SVG charts), so it opens from
``file://`` with no server and no network, can be mailed or archived with the run, and
shows the same thing in ten years. All text in it comes from models and envs and is
HTML-escaped where it is written; the JS only shows and hides what is already there
(filters by env, outcome, end reason and run, also read from the URL's ``#`` part so a
filtered view can be linked), so nothing is ever truncated or rebuilt from data.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent_gym import untrusted
from agent_gym.eval.compare import Comparison, PairedDifference
from agent_gym.eval.runfiles import record_key
from agent_gym.eval.runs import EpisodeKey, Run

OPEN_MESSAGE_CHARS = 2000  # longer messages start collapsed (a click shows them whole)
HISTOGRAM_BINS = 10
MAX_INTEGER_BARS = 40


@dataclass(frozen=True)
class _Anchors:
    """Where each episode is in the page, so runs of the same task can link to each other."""

    by_key: dict[EpisodeKey, list[tuple[int, str]]]  # key -> [(run index, anchor id)]

    @classmethod
    def of(cls, runs: Sequence[Run]) -> _Anchors:
        by_key: dict[EpisodeKey, list[tuple[int, str]]] = {}
        for index, run in enumerate(runs):
            for key, record in run.episodes.items():
                by_key.setdefault(key, []).append((index, _anchor(index, record)))
        return cls(by_key)


def _anchor(run_index: int, record: dict[str, Any]) -> str:
    return f"ep-{run_index}-{int(record['episode'])}"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


@dataclass(frozen=True)
class Compared:
    """A comparison and the runs of its two sides (so flipped tasks link to both)."""

    comparison: Comparison
    side_a: Sequence[Run]
    side_b: Sequence[Run]


def render_report(runs: Sequence[Run], comparisons: Sequence[Compared] = ()) -> str:
    """The whole report of ``runs``, with a section per comparison between them."""
    anchors = _Anchors.of(runs)
    index_of = {id(run): i for i, run in enumerate(runs)}
    envs = sorted({run.config.env_id for run in runs})
    ends = sorted({str(r.get("end_reason", "")) for run in runs for r in run.episodes.values()})
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>agent-gym runs: {_e(', '.join(run.label for run in runs))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>agent-gym eval runs</h1>",
        _summary_table(runs),
        _notes(runs),
    ]
    parts += [_comparison_section(c, index_of, anchors) for c in comparisons]
    parts.append(_histograms(runs, envs))
    parts.append(_filters(runs, envs, ends))
    for index, run in enumerate(runs):
        parts.append(f"<section class='run' id='run-{index}'><h2>Episodes of run {index + 1}: "
                     f"{_e(run.label)} <small>{_e(run.path)}</small></h2>")
        parts += [_episode(index, run, key, record, anchors, runs)
                  for key, record in run.episodes.items()]
        parts.append("</section>")
    parts.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(parts)


# ------------------------------------------------------------------------------ summary
def _summary_table(runs: Sequence[Run]) -> str:
    head = ("run", "env", "policy", "episodes", "success [95% CI]", "mean reward [95% CI]",
            "pass@k [95% CI]", "end reasons", "turns", "tokens", "invalid actions",
            "cut replies", "latency p50 / p95 s (episode, reply)", "errors", "directory")
    rows = []
    warnings = []
    for index, run in enumerate(runs):
        s = run.summary()
        counts = s.reply_counts()
        warnings += [f"<li class='warn'>run {index + 1}: {_e(note)}</li>" for note in s.notes]
        synthetic = " <span class='warn'>(synthetic data)</span>" if s.synthetic else ""
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in (
            f"<a href='#run-{index}'>{index + 1}</a>", _e(s.env_id) + synthetic, _e(s.policy),
            f"{s.episodes} of {run.config.episodes * run.config.rollouts_per_task}"
            f" <small>{s.tasks} task{'s' * (s.tasks != 1)}</small>",
            f"{_figure(s.success_rate, '.3f')} [{s.success_low:.3f}, {s.success_high:.3f}]"
            f" <small>{_e(s.success_interval)}</small>",
            f"{_figure(s.mean_reward, '.3f')}{_interval(s.reward_low, s.reward_high)}",
            _pass_at_k(s.pass_at_k) if s.rollouts_per_task > 1 else "-",
            _e(", ".join(f"{reason} {count}" for reason, count in s.end_reasons.items())),
            _figure(s.mean_turns, ".1f"),
            _figure(s.mean_tokens, ".0f"),
            f"{_figure(counts.invalid_share, '.2f')} <small>{counts.invalid} of "
            f"{counts.actions}</small>",
            f"{_figure(counts.cut_share, '.2f')} <small>{counts.cut} of {counts.episodes}</small>",
            f"{_figure(s.latency_p50, '.2f')} / {_figure(s.latency_p95, '.2f')}<br><small>"
            f"{_figure(s.reply_latency_p50, '.2f')} / {_figure(s.reply_latency_p95, '.2f')}"
            "</small>",
            str(s.errors), f"<code>{_e(run.path)}</code>",
        )) + "</tr>")
    header = "".join(f"<th>{h}</th>" for h in head)
    # The summary's other figures (cut replies, the first error, and whatever a newer eval
    # adds, such as pass@k), as the eval wrote them rather than left out.
    others = []
    for index, run in enumerate(runs):
        extra = {k: v for k, v in dataclasses.asdict(run.summary()).items()
                 if k not in _SUMMARY_SHOWN and v not in (None, 0, False, {}, [])}
        if extra:
            figures = "; ".join(f"{name.replace('_', ' ')}: "
                                f"{json.dumps(value, ensure_ascii=False)}"
                                for name, value in extra.items())
            others.append(f"<li>run {index + 1}, more of its summary: {_e(figures)}</li>")
    other_list = f"<ul class='other-figures'>{''.join(others)}</ul>" if others else ""
    warning_list = (f"<ul class='summary-notes'>{''.join(warnings)}</ul>" if warnings else "")
    return (f"<h2>Summary</h2><table id='summary'><thead><tr>{header}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>{warning_list}{other_list}")


_SUMMARY_SHOWN = frozenset({
    "env_id", "policy", "episodes", "errors", "success_rate", "success_low", "success_high",
    "mean_reward", "mean_turns", "mean_tokens", "latency_p50", "latency_p95", "synthetic",
    "success_interval", "reward_low", "reward_high", "pass_at_k", "end_reasons",
    "rollouts_per_task", "tasks", "notes", "actions", "invalid_actions", "cut_replies",
    "reply_latency_p50", "reply_latency_p95",
})


def _interval(low: float | None, high: float | None) -> str:
    return "" if low is None or high is None else f" [{low:.3f}, {high:.3f}]"


def _pass_at_k(pass_at_k: dict[str, dict[str, float | int | None]]) -> str:
    """One line per k: the estimate over tasks with at least k rollouts, its interval."""
    def number(value: float | int | None) -> float | None:
        return float(value) if isinstance(value, (int, float)) else None

    lines = []
    for k, figure in pass_at_k.items():
        low, high = number(figure.get("low")), number(figure.get("high"))
        lines.append(f"pass@{_e(k)} {_figure(number(figure.get('estimate')), '.3f')}"
                     f"{_interval(low, high)}")
    return "<br>".join(lines)


def _notes(runs: Sequence[Run]) -> str:
    items = [f"<li>run {i + 1}: {_e(note)}</li>" for i, run in enumerate(runs)
             for note in run.notes]
    items += [f"<li>run {i + 1}: episode {_e(error.get('episode'))} failed: "
              f"<code>{_e(error.get('error', ''))}</code></li>"
              for i, run in enumerate(runs) for error in run.errors]
    if not items:
        return ""
    return f"<h2>Read notes</h2><ul class='notes'>{''.join(items)}</ul>"


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# ------------------------------------------------------------------------------ compare
def _comparison_section(compared: Compared, index_of: dict[int, int], anchors: _Anchors) -> str:
    comparison = compared.comparison
    rows = [_comparison_row(env.env_id, env.success, env.reward_a, env.reward_b,
                            len(env.fixed), len(env.broken)) for env in comparison.envs]
    if len(comparison.envs) > 1:
        rows.append(_comparison_row("all", comparison.overall, comparison.reward_a,
                                    comparison.reward_b, len(comparison.fixed),
                                    len(comparison.broken)))
    head = ("env", "paired tasks", "success A", "success B", "B − A [95% CI]", "reward A",
            "reward B", "fixed", "broken")
    parts = [
        "<section class='comparison'><h2>Comparison</h2>",
        f"<p>A = {_e(comparison.label_a)}<br>B = {_e(comparison.label_b)}</p>",
        "<p class='method'>Episodes are paired by env, task and play (a task's rollouts and "
        "repeats, in order); the interval is "
        "Newcombe's score interval for a difference of paired proportions (method 10, "
        "1998).</p>",
        "<table class='compare'><thead><tr>" + "".join(f"<th>{h}</th>" for h in head)
        + f"</tr></thead><tbody>{''.join(rows)}</tbody></table>",
    ]
    if comparison.only_in_a or comparison.only_in_b:
        parts.append(f"<p>Unpaired episodes left out: {comparison.only_in_a} of A, "
                     f"{comparison.only_in_b} of B.</p>")
    if comparison.notes:
        parts.append("<ul class='summary-notes'>" + "".join(
            f"<li class='warn'>{_e(note)}</li>" for note in comparison.notes) + "</ul>")
    side_a = {index_of[id(run)] for run in compared.side_a}
    side_b = {index_of[id(run)] for run in compared.side_b}
    for title, keys in (("Fixed: failed in A, solved in B", comparison.fixed),
                        ("Broken: solved in A, failed in B", comparison.broken)):
        items = []
        for key in keys:
            links = [f"<a href='#{a}'>{'A' if i in side_a else 'B'}</a>"
                     for i, a in anchors.by_key.get(key, []) if i in side_a | side_b]
            items.append(f"<li>{_e(key[0])} <code>{_e(key[1])}</code>"
                         f"{f' play {key[2]}' if key[2] else ''} {' '.join(links)}</li>")
        parts.append(f"<h3>{title} ({len(keys)})</h3><ul class='flips'>{''.join(items)}</ul>")
    parts.append("</section>")
    return "\n".join(parts)


def _comparison_row(env_id: str, d: PairedDifference, reward_a: float, reward_b: float,
                    fixed: int, broken: int) -> str:
    n = d.pairs
    cells = (_e(env_id), str(n), f"{(d.both + d.only_a) / n:.3f}",
             f"{(d.both + d.only_b) / n:.3f}",
             f"{d.difference:+.3f} [{d.low:+.3f}, {d.high:+.3f}]", f"{reward_a:.3f}",
             f"{reward_b:.3f}", str(fixed), str(broken))
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


# ------------------------------------------------------------------------------ charts
def _histograms(runs: Sequence[Run], envs: Sequence[str]) -> str:
    parts = ["<h2>Distributions</h2>"]
    for env_id in envs:
        parts.append(f"<h3>{_e(env_id)}</h3>")
        for index, run in enumerate(runs):
            if run.config.env_id != env_id:
                continue
            records = list(run.episodes.values())
            parts.append(f"<div class='charts'><div class='chart-label'>run {index + 1}: "
                         f"{_e(run.config.policy)}</div>")
            parts.append(_histogram("reward", [float(r["reward"]) for r in records]))
            parts.append(_histogram("turns", [float(r["turns"]) for r in records],
                                    integer=True))
            parts.append(_histogram("latency (s)", [float(r["latency_s"]) for r in records]))
            parts.append("</div>")
    return "\n".join(parts)


def _histogram(title: str, values: list[float], integer: bool = False) -> str:
    """An inline SVG bar chart of ``values``: one bar per integer for counts spanning at
    most ``MAX_INTEGER_BARS``, else ``HISTOGRAM_BINS`` equal bins (a single bar when every
    value is the same). The number of bars never depends on the values: one bar per
    integer of a recorded turn count of 10^8 was a hundred million bars."""
    width, height, pad = 260, 120, 22
    if not values:
        return f"<figure class='hist'><figcaption>{_e(title)}: no episodes</figcaption></figure>"
    low, high = min(values), max(values)
    integer = integer and high - low < MAX_INTEGER_BARS
    if integer:
        edges = [low + i for i in range(int(high - low) + 2)]
    elif high == low:
        edges = [low, low + 1]
    else:
        step = (high - low) / HISTOGRAM_BINS
        edges = [low + i * step for i in range(HISTOGRAM_BINS + 1)]
    bins = len(edges) - 1
    counts = [0] * bins
    for value in values:
        position = (value - edges[0]) / (edges[-1] - edges[0]) * bins
        counts[min(bins - 1, max(0, math.floor(position)))] += 1
    peak = max(counts)
    bar = (width - 2 * pad) / bins
    rects = []
    for i, count in enumerate(counts):
        h = (height - 2 * pad) * count / peak
        label = f"{edges[i]:g}" if integer else f"{edges[i]:.3g} to {edges[i + 1]:.3g}"
        rects.append(
            f"<rect x='{pad + i * bar:.1f}' y='{height - pad - h:.1f}' width='{bar - 1:.1f}' "
            f"height='{h:.1f}'><title>{_e(label)}: {count}</title></rect>"
        )
    axis = (f"<text x='{pad}' y='{height - 6}'>{edges[0]:.3g}</text>"
            f"<text x='{width - pad}' y='{height - 6}' text-anchor='end'>"
            f"{high:.3g}</text>"
            f"<text x='{pad - 4}' y='{pad}' text-anchor='end'>{peak}</text>")
    return (f"<figure class='hist'><figcaption>{_e(title)} (n={len(values)})</figcaption>"
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
            f"viewBox='0 0 {width} {height}' role='img'>{''.join(rects)}{axis}</svg></figure>")


# ------------------------------------------------------------------------------ episodes
def _filters(runs: Sequence[Run], envs: Sequence[str], ends: Sequence[str]) -> str:
    def select(name: str, label: str, options: Sequence[tuple[str, str]]) -> str:
        choices = "".join(f"<option value='{_e(v)}'>{_e(t)}</option>" for v, t in options)
        return (f"<label>{label} <select id='filter-{name}' data-filter='{name}'>"
                f"<option value=''>all</option>{choices}</select></label>")

    total = sum(len(run.episodes) for run in runs)
    return (
        "<h2>Episodes</h2><div id='filters'>"
        + select("env", "env", [(e, e.removeprefix("agent_gym/")) for e in envs])
        + select("success", "outcome", [("yes", "success"), ("no", "failure")])
        + select("end", "end reason", [(e, e or "(none)") for e in ends])
        + select("run", "run", [(str(i), f"{i + 1}: {run.label}") for i, run in enumerate(runs)])
        + f" <span id='shown-count'>{total} of {total} episodes shown</span></div>"
    )


def _episode(index: int, run: Run, key: EpisodeKey, record: dict[str, Any],
             anchors: _Anchors, runs: Sequence[Run]) -> str:
    number = int(record["episode"])
    success = bool(record.get("success"))
    end = str(record.get("end_reason", ""))
    rewards, source = _step_rewards(run, record)
    transcript = record.get("transcript") or []
    turns = int(record.get("turns", 0))
    stepped = turns - (1 if end == "max_tokens" else 0)
    opening = max(0, len(transcript) - 2 * stepped - (1 if end == "max_tokens" else 0))
    header = (
        f"<h3>#{number} · task <code>{_e(key[1])}</code>"
        + (f" · rollout {rollout}" if (rollout := int(record.get("rollout") or 0)) else "")
        + f" · <span class='{'ok' if success else 'bad'}'>{'success' if success else 'failure'}"
        f"</span> · reward {float(record.get('reward', 0.0)):g} · end: {_e(end or '(none)')}"
        f" · {turns} turns · {float(record.get('latency_s', 0.0)):.2f} s"
        f" · seed {_e(record.get('seed'))}</h3>"
    )
    others = [f"<a href='#{a}'>run {i + 1} ({_e(runs[i].config.policy)})</a>"
              for i, a in anchors.by_key.get(key, []) if i != index]
    meta = [header]
    if others:
        meta.append(f"<p class='links'>Same task in: {', '.join(others)}</p>")
    if rewards is not None:
        meta.append(f"<p class='rewards'>Rewards per step ({source}): "
                    f"{_e(', '.join(f'{r:g}' for r in rewards))}</p>")
    else:
        meta.append("<p class='rewards'>Rewards per step: not in this run's log "
                    "(<code>agent-gym view --replay</code> or <code>rescore</code> recovers "
                    "them)</p>")
    replay_error = run.rescored.get(record_key(record), {}).get("error")
    if replay_error:
        meta.append(f"<p class='bad'>Not reproducible from its saved state: {_e(replay_error)}"
                    "</p>")
    tokens = (record.get("prompt_tokens"), record.get("completion_tokens"))
    if tokens != (None, None):
        meta.append(f"<p>Tokens: {_e(tokens[0])} prompt, {_e(tokens[1])} completion; "
                    f"invalid actions: {_e(record.get('invalid_actions', 0))}</p>")
    messages = []
    for position, message in enumerate(transcript):
        step = (position - opening + 1) // 2 if position >= opening else 0
        is_observation = position >= opening and (position - opening) % 2 == 1
        reward = rewards[step - 1] if (is_observation and rewards is not None
                                       and 0 < step <= len(rewards)) else None
        messages.append(_message(message, reward))
    return (
        f"<article class='episode' id='{_anchor(index, record)}' data-run='{index}' "
        f"data-env='{_e(run.config.env_id)}' data-success='{'yes' if success else 'no'}' "
        f"data-end='{_e(end)}'>{''.join(meta)}<div class='transcript'>{''.join(messages)}"
        "</div></article>"
    )


def _step_rewards(run: Run, record: dict[str, Any]) -> tuple[list[float] | None, str]:
    recorded = record.get("step_rewards")
    if isinstance(recorded, list):
        return [float(r) for r in recorded], "as recorded"
    rescored = run.rescored.get(record_key(record), {}).get("step_rewards")
    if isinstance(rescored, list):
        return [float(r) for r in rescored], "replayed from the saved state"
    return None, ""


def _message(message: Any, reward: float | None) -> str:
    if not isinstance(message, dict):
        message = {"role": "?", "content": json.dumps(message)}
    role = str(message.get("role", "?"))
    content = message.get("content")
    if content is None:  # a native tool call's reply may have no text
        content = ""
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    label = role
    if role == "assistant" and "<tool_call>" in text:
        label += " · tool call"
    label += f" · {len(text):,} chars"
    if reward is not None:
        label += f" · reward {reward:g}"
    extra = {k: v for k, v in message.items() if k not in ("role", "content")}
    extra_block = (f"<pre class='extra'>{_e(json.dumps(extra, indent=1, ensure_ascii=False))}"
                   "</pre>") if extra else ""
    calls = "".join(_tool_call(body) for body in _tool_call_bodies(text)) if (
        role == "assistant") else ""
    opened = " open" if len(text) <= OPEN_MESSAGE_CHARS and role != "system" else ""
    role_class = "".join(c if c.isalnum() else "-" for c in role)
    return (f"<details class='msg role-{role_class}'{opened}><summary>{_e(label)}</summary>"
            f"<pre class='content'>{_e(text)}</pre>{calls}{extra_block}</details>")


def _tool_call_bodies(text: str) -> list[str]:
    """The bodies of ``<tool_call>...</tool_call>`` blocks, in one pass over ``text``."""
    bodies, start = [], 0
    while (opening := text.find("<tool_call>", start)) != -1:
        closing = text.find("</tool_call>", opening)
        if closing == -1:
            break
        bodies.append(text[opening + len("<tool_call>"):closing])
        start = closing + len("</tool_call>")
    return bodies


def _tool_call(body: str) -> str:
    """A JSON tool call laid out for reading: its name, then each argument as text (code
    arrives as one JSON string with its line breaks escaped). Anything else: nothing, the
    message above shows it as written."""
    try:  # model text recorded in a run: as untrusted as any run file
        call = untrusted.loads(body)
    except untrusted.UntrustedJSONError:
        return ""
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
        return ""
    rows = "".join(
        f"<div class='arg'>{_e(key)}:</div><pre class='arg-value'>"
        f"{_e(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))}</pre>"
        for key, value in call["arguments"].items()
    )
    return f"<div class='tool-call'>tool call <b>{_e(call.get('name'))}</b>{rows}</div>"


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1b1b;background:#fafafa}
table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eee}
code{font-size:12px}
.ok{color:#137333;font-weight:600}.bad{color:#b3261e;font-weight:600}.warn{color:#b06000}
.charts{display:flex;gap:1em;align-items:flex-end;flex-wrap:wrap;margin:.3em 0}
.chart-label{width:10em}
.hist{margin:0}.hist figcaption{font-size:12px}
.hist rect{fill:#4a72b0}.hist text{font-size:10px;fill:#444}
#filters{position:sticky;top:0;background:#fafafa;padding:.5em 0;border-bottom:1px solid #ccc;
z-index:1}
#filters label{margin-right:1em}
.episode{border:1px solid #ccc;background:#fff;margin:.8em 0;padding:.3em .8em}
.episode h3{font-size:14px;margin:.3em 0}
.msg{margin:.2em 0;border-left:4px solid #999;padding-left:.5em}
.msg summary{cursor:pointer;color:#555;font-size:12px}
.role-assistant{border-color:#4a72b0}.role-tool{border-color:#137333}
.role-user{border-color:#b06000}.role-system{border-color:#888}
.tool-call{background:#eef3fb;padding:.2em .5em;margin:.2em 0;font-size:12px}
.arg{color:#555}
pre{white-space:pre-wrap;word-break:break-word;margin:.2em 0;font-size:12px}
"""

# Filters are read from and written to the URL's # part (env=...&success=yes|no&end=...&
# run=N), so a filtered view is a link; an episode's own #ep-R-N anchor clears them.
_JS = """
(function(){
  var selects = Array.prototype.slice.call(document.querySelectorAll('#filters select'));
  var episodes = Array.prototype.slice.call(document.querySelectorAll('.episode'));
  var count = document.getElementById('shown-count');
  function apply(){
    var shown = 0;
    episodes.forEach(function(ep){
      var ok = selects.every(function(s){
        return !s.value || ep.dataset[s.dataset.filter] === s.value;
      });
      ep.hidden = !ok;
      if (ok) shown++;
    });
    count.textContent = shown + ' of ' + episodes.length + ' episodes shown';
  }
  function fromHash(){
    var params = new URLSearchParams(location.hash.slice(1));
    selects.forEach(function(s){ s.value = params.get(s.dataset.filter) || ''; });
    apply();
  }
  selects.forEach(function(s){
    s.addEventListener('change', function(){
      var params = new URLSearchParams();
      selects.forEach(function(t){ if (t.value) params.set(t.dataset.filter, t.value); });
      history.replaceState(null, '', '#' + params.toString());
      apply();
    });
  });
  window.addEventListener('hashchange', fromHash);
  fromHash();
})();
"""
