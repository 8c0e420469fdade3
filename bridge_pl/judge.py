"""Reasoning quality: an LLM judge scores each evaluated trajectory 1-5 on a fixed rubric (reference-free).

The judge reads the question (with its options), the whole trajectory (the agent's thinking, its searches and
the passages it was shown) and the final answer, never the gold answer, and replies ``Score: N``. The prompt is
:data:`JUDGE_PROMPT` (also printed in docs/medical.md). Two judges: :class:`HFJudge` (any local Hugging Face
causal LM) and :class:`OpenAIJudge` (any OpenAI-compatible chat endpoint, e.g. ``vllm serve`` on the user's
machine; stdlib HTTP only).

:func:`judge_verdicts` judges predictions records through a :class:`JudgeCache` (a jsonl file keyed by the judge
and the exact prompt), so an interrupted evaluation resumes without asking again. A reply without a parseable
score is counted and kept (``reasoning_quality`` null), a failed request too; neither ever raises.
:func:`apply_verdicts` writes the verdicts into the records and :func:`summarize` sums them up; the steps are
separate so that several processes can each judge a share of a set and one of them sum up the whole
(``callbacks.QAEval``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.client
import json
import os
import re
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bridge_pl.models import load_causal_lm, load_tokenizer, resolve_model

JUDGE_PROMPT = """You are grading the reasoning of a search agent that answered a question by thinking, \
searching a document collection and reading the passages it found. Do not judge whether the final answer is \
correct (you are not told the correct answer); judge how well the reasoning supports it.

Rate the trajectory from 1 to 5 on three criteria together:
- Logical coherence: each step follows from the previous ones and from the question; no contradictions.
- Use of the retrieved evidence: the searches target what is missing, and the reasoning rests on what the \
passages say rather than on unsupported claims.
- Consistency with the final answer: the final answer is the one the reasoning arrives at.

5 = coherent, grounded in the evidence and consistent throughout; 4 = minor gaps; 3 = partly supported or \
partly inconsistent; 2 = mostly unsupported or incoherent; 1 = no usable reasoning, or reasoning that \
contradicts the answer.

Question: {question}
{options}
Trajectory:
{trajectory}

Final answer: {answer}

Reply with one line of the form "Score: N", where N is 1, 2, 3, 4 or 5."""

_SCORE = re.compile(r"score\s*(?:[:=]|is)?\s*\**\s*([1-5])(?!\d|\.\d)", re.IGNORECASE)
_BARE = re.compile(r"\**\s*([1-5])(?:\s*/\s*5)?\s*\**\.?")


def parse_score(reply: str | None) -> int | None:
    """The 1-5 score of a judge reply: the last ``Score: N`` (also ``score = N``, ``Score: **N**``, ``score is N``),
    or a reply that is only ``N`` or ``N/5``; None when there is none (``Score: 7``, ``Score: 4.5``, prose)."""
    if reply is None:
        return None
    found = _SCORE.findall(reply)
    if found:
        return int(found[-1])
    bare = _BARE.fullmatch(reply.strip())
    return int(bare[1]) if bare else None


def judge_prompt(record: dict[str, Any], max_trajectory_chars: int) -> str:
    """The judge's prompt for one predictions record (``question``, ``options``, ``response``, ``prediction``).

    A trajectory longer than ``max_trajectory_chars`` keeps its head and tail (its last steps and answer) with
    ``[...]`` in between.
    """
    trajectory = record["response"]
    if len(trajectory) > max_trajectory_chars:
        half = max_trajectory_chars // 2
        trajectory = f"{trajectory[:half]}\n[...]\n{trajectory[-half:]}"
    options = record.get("options") or {}
    lines = "".join(f"{letter}. {text}\n" for letter, text in options.items())
    return JUDGE_PROMPT.format(question=record["question"], options=f"Options:\n{lines}" if lines else "",
                               trajectory=trajectory, answer=record["prediction"] or "(no answer)")


@dataclass(frozen=True)
class Reply:
    """A judge's reply to one prompt: its text, or None and why the request failed."""

    text: str | None
    error: str | None = None


class Judge(ABC):
    """An LLM that answers judge prompts. ``identity`` names it in the cache (a new judge asks again).

    Args:
        max_trajectory_chars: a longer trajectory is cut in the middle before it is shown (see
            :func:`judge_prompt`).
    """

    def __init__(self, max_trajectory_chars: int = 12_000) -> None:
        if max_trajectory_chars < 200:
            raise ValueError(f"judge: max_trajectory_chars must be >= 200, got {max_trajectory_chars}")
        self.max_trajectory_chars = max_trajectory_chars

    @property
    @abstractmethod
    def identity(self) -> str:
        """A string naming the judge model and its decoding settings."""

    @abstractmethod
    def reply(self, prompts: Sequence[str]) -> list[Reply]:
        """One :class:`Reply` per prompt, in order; failures are replies with an error, never exceptions."""


class HFJudge(Judge):
    """A local Hugging Face causal LM as the judge (greedy decoding, chat template when it has one).

    Args:
        model: a registry name (``smollm2-135m-instruct``), a local folder or a cached hub id.
        max_new_tokens: reply length; ``Score: N`` needs about 5 tokens.
        batch_size: prompts per generate call.
        device: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:1``, ...
        dtype: ``float32``, ``bfloat16`` or ``float16``.
    """

    def __init__(self, model: str, max_new_tokens: int = 16, batch_size: int = 8, device: str = "auto",
                 dtype: str = "float32", max_trajectory_chars: int = 12_000) -> None:
        super().__init__(max_trajectory_chars)
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"HFJudge: dtype must be float32, bfloat16 or float16, got {dtype!r}")
        if max_new_tokens < 1 or batch_size < 1:
            raise ValueError(f"HFJudge: max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, "
                             f"{batch_size}")
        resolve_model(model)  # a judge that cannot load fails here, not at the first evaluation
        self.model_name, self.max_new_tokens, self.batch_size = model, max_new_tokens, batch_size
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.dtype = getattr(torch, dtype)
        self._model = self._tokenizer = None

    @property
    def identity(self) -> str:
        return f"hf:{self.model_name}:{self.dtype}:greedy:{self.max_new_tokens}"

    def _load(self) -> None:
        self._tokenizer = load_tokenizer(self.model_name)
        self._tokenizer.padding_side = "left"  # generation continues every row from its own last token
        self._model = load_causal_lm(self.model_name, dtype=self.dtype).to(self.device).eval()

    def _text(self, prompt: str) -> str:
        if getattr(self._tokenizer, "chat_template", None):
            return self._tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       add_generation_prompt=True, tokenize=False)
        return prompt

    def reply(self, prompts: Sequence[str]) -> list[Reply]:
        if self._model is None:
            self._load()
        replies: list[Reply] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = [self._text(p) for p in prompts[start : start + self.batch_size]]
            try:
                enc = self._tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
                enc = enc.to(self.device)
                with torch.no_grad():
                    out = self._model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                               pad_token_id=self._tokenizer.pad_token_id)
                texts = self._tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                replies += [Reply(t) for t in texts]
            except (RuntimeError, ValueError) as err:  # e.g. out of memory: these rows count as failed
                replies += [Reply(None, f"{type(err).__name__}: {err}".splitlines()[0])] * len(chunk)
        return replies


class OpenAIJudge(Judge):
    """Any OpenAI-compatible chat-completions endpoint as the judge (``vllm serve``, a hosted API), over stdlib HTTP.

    Args:
        base_url: the API root, e.g. ``http://localhost:8000/v1`` (``/chat/completions`` is appended).
        model: the served model's name.
        api_key_env: the environment variable holding the API key (sent as a bearer token when set).
        max_tokens: reply length.
        timeout: seconds per request.
        retries: extra tries of a request that failed (connection error, HTTP 5xx or 429).
        concurrency: requests in flight at once.
    """

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY", max_tokens: int = 16,
                 timeout: float = 60.0, retries: int = 2, concurrency: int = 8,
                 max_trajectory_chars: int = 12_000) -> None:
        super().__init__(max_trajectory_chars)
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"OpenAIJudge: base_url must start with http:// or https://, got {base_url!r}")
        if retries < 0 or concurrency < 1 or timeout <= 0:
            raise ValueError("OpenAIJudge: retries must be >= 0, concurrency >= 1 and timeout > 0")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key_env, self.max_tokens = model, api_key_env, max_tokens
        self.timeout, self.retries, self.concurrency = timeout, retries, concurrency

    @property
    def identity(self) -> str:
        return f"openai:{self.url}:{self.model}:greedy:{self.max_tokens}"

    def _ask(self, prompt: str) -> Reply:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                           "temperature": 0.0, "max_tokens": self.max_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if key := os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {key}"
        error = ""
        for _ in range(self.retries + 1):
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    payload = json.loads(response.read().decode("utf-8"))
                content = payload["choices"][0]["message"]["content"]
                if not isinstance(content, str):
                    return Reply(None, f"the reply's content is {type(content).__name__}, not text")
                return Reply(content)
            except urllib.error.HTTPError as err:
                error = f"HTTP {err.code} from {self.url}"
                if err.code < 500 and err.code != 429:
                    break  # a client error: asking again gives the same answer
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, cut short
                error = f"no reply from {self.url} ({getattr(err, 'reason', err)})"
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, IndexError, TypeError) as err:
                return Reply(None, f"not an OpenAI chat-completions reply ({type(err).__name__}: {err})")
        return Reply(None, error)

    def reply(self, prompts: Sequence[str]) -> list[Reply]:
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._ask, prompts))


class JudgeCache:
    """Judge replies on disk (jsonl, one ``{key, reply, score}`` per line, appended as they come), so that an
    interrupted or repeated evaluation asks the judge only for prompts it has not answered. Failed requests are
    not stored. A torn last line (the process died while writing) is ignored.

    Each process appends to a file of its own, so that lines of several ranks never interleave: rank 0 to ``path``,
    rank r to ``<stem>.rank<r><suffix>`` beside it (``judge_cache.rank1.jsonl``). Every cache reads ``path`` and
    all those files, so a run with any number of ranks finds what any rank of an earlier run was told.

    Args:
        path: the cache file.
        rank: the process's global rank (which file it appends to).
    """

    def __init__(self, path: str | Path, rank: int = 0) -> None:
        self.path = Path(path)
        self.own = self.path if rank == 0 else self.path.with_name(f"{self.path.stem}.rank{rank}{self.path.suffix}")
        self.entries: dict[str, dict[str, Any]] = {}
        self._torn = False  # the own file ends in a torn line: the next entry must start on a new line
        for file in [self.path, *self.rank_files()]:
            text = self._read(file)
            if file == self.own:
                self._torn = bool(text) and not text.endswith("\n")

    def rank_files(self) -> list[Path]:
        """The files of ranks other than 0 beside ``path``, in rank order."""
        pattern = re.compile(rf"{re.escape(self.path.stem)}\.rank(\d+){re.escape(self.path.suffix)}")
        found = [(int(m[1]), f) for f in self.path.parent.glob("*") if (m := pattern.fullmatch(f.name))]
        return [f for _, f in sorted(found)]

    def _read(self, file: Path) -> str:
        """Add ``file``'s entries (if it exists); its text."""
        text = file.read_text(encoding="utf-8") if file.is_file() else ""
        for line in text.split("\n"):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and "key" in entry:
                self.entries[entry["key"]] = entry
        return text

    @staticmethod
    def key(judge: Judge, prompt: str) -> str:
        return hashlib.sha256(f"{judge.identity}\0{prompt}".encode()).hexdigest()

    def add(self, key: str, reply: str, score: int | None) -> None:
        entry = {"key": key, "reply": reply, "score": score}
        self.entries[key] = entry
        self.own.parent.mkdir(parents=True, exist_ok=True)
        with open(self.own, "a", encoding="utf-8") as f:
            f.write(("\n" if self._torn else "") + json.dumps(entry, ensure_ascii=False) + "\n")
        self._torn = False


@dataclass(frozen=True)
class Verdict:
    """The judgement of one record: its score (None: the reply held none, or there was no reply), the reply (or
    ``"error: ..."`` when the request failed) and whether it failed."""

    score: int | None
    reply: str
    failed: bool = False


@dataclass
class JudgeSummary:
    """What judging one set gave: the mean score over parsed replies (None if none parsed) and the counts."""

    reasoning_quality: float | None
    judged: int  # rows whose reply parsed
    unparsed: int  # rows whose reply held no score
    failed: int  # rows whose request got no reply
    example: str | None  # the first unparsed reply or failure, for the log


CHUNK = 64  # prompts per judge call; each chunk is stored before the next, so an interruption loses at most one


def judge_verdicts(judge: Judge, records: list[dict[str, Any]], cache: JudgeCache,
                   progress: Callable[[int, int], None] | None = None) -> list[Verdict]:
    """One :class:`Verdict` per record (predictions records), in order. Cached prompts are not asked again;
    ``progress(asked, to_ask)`` is called after each chunk of prompts the judge answered."""
    prompts = [judge_prompt(r, judge.max_trajectory_chars) for r in records]
    keys = [JudgeCache.key(judge, p) for p in prompts]
    todo = [i for i, k in enumerate(keys) if k not in cache.entries]
    errors: dict[int, str] = {}
    for start in range(0, len(todo), CHUNK):
        chunk = todo[start : start + CHUNK]
        for i, reply in zip(chunk, judge.reply([prompts[i] for i in chunk])):
            if reply.text is None:
                errors[i] = f"error: {reply.error}"
            else:
                cache.add(keys[i], reply.text, parse_score(reply.text))
        if progress is not None:
            progress(start + len(chunk), len(todo))
    verdicts = []
    for i, key in enumerate(keys):  # a prompt asked twice counts as answered if either request got a reply
        entry = cache.entries.get(key)
        verdicts.append(Verdict(None, errors[i], True) if entry is None else Verdict(entry["score"], entry["reply"]))
    return verdicts


def apply_verdicts(records: list[dict[str, Any]], verdicts: Sequence[Verdict]) -> None:
    """Set each record's ``reasoning_quality`` (1-5 or None) and ``judge_reply`` from its verdict."""
    for record, verdict in zip(records, verdicts, strict=True):
        record["reasoning_quality"], record["judge_reply"] = verdict.score, verdict.reply


def summarize(verdicts: Sequence[Verdict]) -> JudgeSummary:
    """The mean score over the verdicts whose reply parsed, and the counts of unparsed and failed ones."""
    scores = [v.score for v in verdicts if v.score is not None]
    failed = sum(v.failed for v in verdicts)
    unparsed = len(verdicts) - len(scores) - failed
    example = next((v.reply if v.failed else f"unparsed reply {v.reply!r}" for v in verdicts if v.score is None),
                   None)
    return JudgeSummary(sum(scores) / len(scores) if scores else None, len(scores), unparsed, failed, example)

