"""The kv-trace's sessions: a seeded generator with published agentic statistics, the trace file.

Benchmark side, control plane: no I/O but the trace file itself. A trace is sessions of
rounds; each round says its whole prompt (``input_tokens``), how many leading tokens equal
the previous round's context (``prefix_tokens``), its answer (``output_tokens``) and the
think time before it. The file format is in :mod:`phoenix.bench.kvtrace`'s docstring.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field

FORMAT = "phx-kv-trace"
VERSION = 1


@dataclass
class Round:
    think_s: float
    input_tokens: int
    prefix_tokens: int
    output_tokens: int

    @property
    def new_tokens(self) -> int:
        return self.input_tokens - self.prefix_tokens


@dataclass
class Session:
    id: str
    rounds: list[Round] = field(default_factory=list)


@dataclass
class Trace:
    sessions: list[Session]
    params: dict = field(default_factory=dict)


#: the published statistics the generator aims at (Codex on SWE-bench Pro)
TARGETS = {
    "context_at_round_30": 80_000,
    "beyond_180k": "some sessions",
    "new_tokens_per_round": "hundreds to a few thousand",
    "think_s": "a few seconds",
    "input_output_ratio": 131,
    "prefix_hit_rate": 0.94,
}


def generate(sessions: int = 64, seed: int = 0) -> Trace:
    """Agentic sessions with the published statistics of Codex runs on SWE-bench Pro (seeded).

    Per session: a first prompt of system prompt, tools and task (~12K tokens); then rounds
    that each add a tool result or user turn (log-normal, median ~1.6K tokens, 100..8K) and
    the previous answer; a per-session pace factor spreads the growth (context ~80K at round
    30, the long ones past 180K); answers of ~350 tokens (input:output ~131:1); think times
    log-normal around 3 s. About one round in ten edits earlier context (the agent rewrites
    or trims it): the prefix then ends inside the old context, which is resent -- this is
    what brings the prefix hit rate from ~97 % (new tokens only) to ~94 %.
    """
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        n_rounds = int(min(90, max(8, rng.lognormvariate(math.log(38), 0.5))))
        pace = rng.lognormvariate(0.0, 0.3)
        ctx = int(min(20_000, max(6_000, rng.gauss(12_000, 2_000))))
        rounds = [Round(0.0, ctx, 0, _output(rng))]
        for _ in range(1, n_rounds):
            prev = rounds[-1]
            carried = prev.input_tokens + prev.output_tokens
            new = int(min(8_000, max(100, rng.lognormvariate(math.log(1_400), 0.75) * pace)))
            prefix = carried
            if rng.random() < 0.10:  # context edit: the tail of the old context is resent
                prefix = int(carried * rng.uniform(0.55, 0.95))
            think = min(30.0, max(0.5, rng.lognormvariate(math.log(3.0), 0.5)))
            rounds.append(Round(round(think, 3), carried + new, prefix, _output(rng)))
        out.append(Session(f"s{s}", rounds))
    return Trace(
        out, {"generator": "phoenix.bench.kvtrace.generate", "sessions": sessions, "seed": seed, "targets": TARGETS}
    )


def _output(rng: random.Random) -> int:
    return int(min(4_000, max(20, rng.lognormvariate(math.log(480), 0.6))))


def write_trace(trace: Trace, path: str) -> None:
    with open(path, "w") as fh:
        fh.write(json.dumps({"format": FORMAT, "version": VERSION, "params": trace.params}) + "\n")
        for s in trace.sessions:
            for r, rd in enumerate(s.rounds):
                fh.write(
                    json.dumps(
                        {
                            "session": s.id,
                            "round": r,
                            "think_s": rd.think_s,
                            "input_tokens": rd.input_tokens,
                            "prefix_tokens": rd.prefix_tokens,
                            "output_tokens": rd.output_tokens,
                        }
                    )
                    + "\n"
                )


def read_trace(path: str) -> Trace:
    """Read a trace file (JSON lines as written by :func:`write_trace`, or one JSON document
    ``{"format": ..., "rounds": [...]}``/a list of round records). Checks every round."""
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory, not a trace file")
    with open(path) as fh:
        text = fh.read()
    params: dict = {}
    records: list[dict] = []
    stripped = text.lstrip()
    doc = None
    if stripped.startswith("[") or (stripped.startswith("{") and "\n{" not in stripped.strip()):
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            doc = None
    if isinstance(doc, dict) and ("rounds" in doc or "params" in doc):
        params = doc.get("params", {})
        records = doc.get("rounds", [])
    elif isinstance(doc, dict):  # one line of JSON lines: a record (a header alone: none)
        records = [] if doc.get("format") == FORMAT else [doc]
    elif doc is not None:
        records = doc
    else:
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i + 1}: not JSON: {exc}") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{i + 1}: a record is a JSON object, not {type(rec).__name__}")
            if rec.get("format") == FORMAT:
                if rec.get("version", VERSION) > VERSION:
                    raise ValueError(f"{path}: trace version {rec['version']} is newer than this reader ({VERSION})")
                params = rec.get("params", {})
            else:
                records.append(rec)
    if not isinstance(params, dict) or not isinstance(records, list):
        raise ValueError(f"{path}: params must be a JSON object and rounds a list")
    sessions: dict[str, list] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: record {i}: a JSON object, not {type(rec).__name__}")
        try:
            sid = str(rec["session"])
            sessions.setdefault(sid, []).append(
                (int(rec.get("round", len(sessions[sid]) if sid in sessions else 0)), rec)
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: record {i}: {exc!r} (needs session, input_tokens)") from None
    out = []
    for sid, recs in sessions.items():
        recs.sort(key=lambda x: x[0])
        rounds: list[Round] = []
        for r, rec in recs:
            carried = rounds[-1].input_tokens + rounds[-1].output_tokens if rounds else 0
            try:
                c = int(rec["input_tokens"])
                p = int(rec.get("prefix_tokens", min(carried, c)))
                o = int(rec.get("output_tokens", 0))
                think = float(rec.get("think_s", 0.0))
            except KeyError as exc:
                raise ValueError(f"{path}: session {sid} round {r}: no {exc.args[0]}") from None
            except (TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"{path}: session {sid} round {r}: {exc}") from None
            if not (0 <= think < 1e9):
                raise ValueError(f"{path}: session {sid} round {r}: think_s={think} must be in [0, 1e9) seconds")
            if not (0 <= p <= c) or p > carried or o < 0:
                raise ValueError(
                    f"{path}: session {sid} round {r}: prefix_tokens={p} must be within [0, input_tokens={c}] "
                    f"and at most the previous context {carried}; output_tokens={o} >= 0"
                )
            rounds.append(Round(think, c, p, o))
        out.append(Session(sid, rounds))
    return Trace(out, params)


def trace_stats(trace: Trace) -> dict:
    """The statistics the generator aims at, measured on a trace."""

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0

    at30 = [s.rounds[30].input_tokens for s in trace.sessions if len(s.rounds) > 30]
    news = [r.new_tokens for s in trace.sessions for r in s.rounds[1:]]
    added = [
        b.input_tokens - a.input_tokens - a.output_tokens
        for s in trace.sessions
        for a, b in zip(s.rounds, s.rounds[1:], strict=False)
    ]
    thinks = [r.think_s for s in trace.sessions for r in s.rounds[1:]]
    inp = sum(r.input_tokens for s in trace.sessions for r in s.rounds)
    outp = sum(r.output_tokens for s in trace.sessions for r in s.rounds)
    pre = sum(r.prefix_tokens for s in trace.sessions for r in s.rounds)
    peak = [max(r.input_tokens for r in s.rounds) for s in trace.sessions if s.rounds]
    return {
        "sessions": len(trace.sessions),
        "rounds": sum(len(s.rounds) for s in trace.sessions),
        "context_at_round_30_median": pct(at30, 0.5),
        "sessions_reaching_round_30": len(at30),
        "sessions_beyond_180k": sum(p > 180_000 for p in peak),
        "max_context": max(peak, default=0),
        "added_tokens_p10": pct(added, 0.1),
        "added_tokens_median": pct(added, 0.5),
        "added_tokens_p90": pct(added, 0.9),
        "new_tokens_p10": pct(news, 0.1),
        "new_tokens_median": pct(news, 0.5),
        "new_tokens_p90": pct(news, 0.9),
        "think_s_median": pct(thinks, 0.5),
        "input_output_ratio": inp / outp if outp else 0.0,
        "prefix_hit_rate": pre / inp if inp else 0.0,
    }


def scale_trace(trace: Trace, token_scale: float) -> Trace:
    """Every token count times ``token_scale`` (at least 1 new token a round)."""
    if token_scale == 1.0:
        return trace
    out = []
    for s in trace.sessions:
        rounds = []
        for rd in s.rounds:
            carried = rounds[-1].input_tokens + rounds[-1].output_tokens if rounds else 0
            p = min(carried, int(rd.prefix_tokens * token_scale))
            c = max(p + 1, int(rd.input_tokens * token_scale))
            rounds.append(Round(rd.think_s, c, p, max(0, int(rd.output_tokens * token_scale))))
        out.append(Session(s.id, rounds))
    return Trace(out, dict(trace.params, token_scale=token_scale))
