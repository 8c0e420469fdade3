"""The search environment: the tag grammar the policy writes and the text the environment answers with.

Pure Python (no torch). Defaults reproduce Search-R1 (``search_r1/llm_agent/generation.py``) byte for byte:

- the policy writes ``<think>…</think>``, ``<search>query</search>``, ``<answer>…</answer>``;
- a turn is cut at the first ``</search>`` or ``</answer>`` (:attr:`SearchEnv.stop_strings`);
- a search is answered with ``\\n\\n<information>{docs}</information>\\n\\n`` where ``docs`` is
  ``Doc 1(Title: "T1") text1\\nDoc 2(Title: "T2") text2`` (Search-R1 prints the first line of the corpus'
  ``contents``, which is the quoted title, and strips the joined docs);
- anything else gets Search-R1's corrective message and the episode goes on.

Parsing rules (:meth:`SearchEnv.parse_action`), for any text the model may emit:

1. Tags are exact and case-sensitive (``<search>``; ``<search >`` or ``<SEARCH>`` is plain text).
2. ``<information>`` written by the model opens an inert block that lasts to the next ``</information>``
   (or the end of the turn): tags inside it are ignored. Model-written information is policy text (it is
   masked as action tokens), never retrieved text, and it cannot trigger an action.
3. The first closing ``</search>`` / ``</answer>`` outside inert blocks decides the turn; later text is
   ignored (the engine cuts generation there anyway). No such closing tag -> invalid (unclosed tags too).
4. That closing tag forms an action only if the nearest grammar tag before it is the matching opening tag:
   ``<search>a <search>b</search>`` searches ``b``; ``<search>a <answer>b</search>`` or a query that contains
   ``<think>…</think>`` is invalid.
5. The content is stripped; empty content is invalid (for answers too: the model gets to try again).
6. A query longer than ``max_query_tokens`` tokens is truncated to that many tokens (invalid if nothing but
   white space is left).
7. Any ``str`` parses, text no tokenizer decode gives included (a reward plug-in's or a file's): a lone UTF-16
   surrogate, which no tokenizer encodes and UTF-8 cannot hold, reads as U+FFFD.

Turn limit: turns ``1..max_turns`` may search. The environment's reply to turn ``max_turns`` ends with
:attr:`EnvConfig.final_notice` (set it to ``""`` for Search-R1's silent final turn); turn ``max_turns + 1``
is the final one: an answer finishes the episode, anything else (a search included, which is not executed)
counts as invalid and ends it. The engine applies this rule; the env supplies the texts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Protocol

from bridge_pl.records import Passage

_SURROGATE = re.compile("[\ud800-\udfff]")

ActionKind = Literal["search", "answer", "invalid"]
TagKind = Literal["think", "search", "answer", "information"]


class TextCodec(Protocol):
    """What the env needs from a tokenizer (any Hugging Face tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Action:
    """One parsed turn: ``kind`` and its content (the query or the answer; ``""`` when invalid)."""

    kind: ActionKind
    content: str = ""


SEARCH_R1_INVALID = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <{search}> and "
    "</{search}>. If I want to give the final answer, I should put the answer between <{answer}> and "
    "</{answer}>. Let me try again.\n"
)
FINAL_NOTICE = (
    "\nI have used all my searches. I must now give the final answer between <{answer}> and </{answer}>.\n"
)


@dataclass
class EnvConfig:
    """Tag names, reply templates and token budgets of :class:`SearchEnv`.

    Templates are ``str.format`` strings. ``observation_template`` gets ``{tag}`` (the information tag)
    and ``{docs}``; ``doc_template`` gets ``{index}`` (1-based), ``{title}``, ``{text}``, ``{id}``;
    ``invalid_message`` and ``final_notice`` get ``{search}``, ``{answer}``, ``{think}``, ``{information}``
    (the tag names). Budgets are in tokens of the policy's tokenizer.
    """

    think_tag: str = "think"
    search_tag: str = "search"
    answer_tag: str = "answer"
    information_tag: str = "information"
    observation_template: str = "\n\n<{tag}>{docs}</{tag}>\n\n"
    doc_template: str = 'Doc {index}(Title: "{title}") {text}\n'
    strip_docs: bool = True
    invalid_message: str = SEARCH_R1_INVALID
    final_notice: str = FINAL_NOTICE
    max_query_tokens: int = 128
    max_observation_tokens: int = 500

    def tag_names(self) -> dict[TagKind, str]:
        """``{"think": ..., "search": ..., "answer": ..., "information": ...}``: the tag name of each kind."""
        return {"think": self.think_tag, "search": self.search_tag, "answer": self.answer_tag,
                "information": self.information_tag}

    def open_tag(self, kind: TagKind) -> str:
        """``<name>`` of the tag of ``kind``."""
        return f"<{self.tag_names()[kind]}>"

    def close_tag(self, kind: TagKind) -> str:
        """``</name>`` of the tag of ``kind``."""
        return f"</{self.tag_names()[kind]}>"

    def wrap(self, kind: TagKind, content: str) -> str:
        """``<name> content </name>``, the way the policy is asked to write a tag."""
        return f"{self.open_tag(kind)} {content} {self.close_tag(kind)}"

    def __post_init__(self) -> None:
        tags = {
            "think_tag": self.think_tag, "search_tag": self.search_tag,
            "answer_tag": self.answer_tag, "information_tag": self.information_tag,
        }
        for name, tag in tags.items():
            if not re.fullmatch(r"[A-Za-z_][\w\-]*", tag):
                raise ValueError(f"EnvConfig.{name}: expected a tag name like 'search', got {tag!r}")
        if len(set(tags.values())) != len(tags):
            raise ValueError(f"EnvConfig: tag names must be distinct, got {sorted(tags.values())}")
        for name in ("max_query_tokens", "max_observation_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EnvConfig.{name} must be >= 1, got {getattr(self, name)}")
        if "{docs}" not in self.observation_template:
            raise ValueError("EnvConfig.observation_template must contain '{docs}'")
        if not self.invalid_message.strip():
            raise ValueError("EnvConfig.invalid_message must not be empty (the policy needs a reply)")


class SearchEnv:
    """Parses the policy's turns into actions and renders the environment's replies.

    Args:
        config: tags, templates and budgets (default: Search-R1's).
        tokenizer: the policy's tokenizer; used to enforce the query and observation token budgets.
    """

    def __init__(self, config: EnvConfig | None = None, tokenizer: TextCodec | None = None) -> None:
        if tokenizer is None:
            raise ValueError("SearchEnv needs the policy's tokenizer (token budgets are in its tokens)")
        self.config = config or EnvConfig()
        self.tokenizer = tokenizer
        c = self.config
        names = c.tag_names()
        self.invalid_message = c.invalid_message.format(**names)
        self.final_notice = c.final_notice.format(**names)
        self._tag_re = re.compile("<(/?)(" + "|".join(re.escape(t) for t in names.values()) + ")>")
        overhead = self._count(c.observation_template.format(tag=c.information_tag, docs=""))
        if overhead > c.max_observation_tokens:
            raise ValueError(
                f"EnvConfig.max_observation_tokens={c.max_observation_tokens} is smaller than the "
                f"observation_template alone ({overhead} tokens)"
            )

    @property
    def stop_strings(self) -> tuple[str, str]:
        """Generation of a turn ends right after the first of these."""
        return self.config.close_tag("search"), self.config.close_tag("answer")

    # ---- parsing ------------------------------------------------------------------------------
    def parse_action(self, text: str) -> Action:
        """The action of one turn of policy text (see the module docstring for the rules); any ``str`` parses."""
        c = self.config
        text = _SURROGATE.sub("\ufffd", text)  # one character for one
        inert = False
        last_open: tuple[str, int] | None = None  # (tag, end offset) of the nearest grammar tag if opening
        for m in self._tag_re.finditer(text):
            closing, tag = m.group(1) == "/", m.group(2)
            if tag == c.information_tag:
                inert = not closing
                last_open = None
                continue
            if inert:
                continue
            if closing and tag in (c.search_tag, c.answer_tag):
                if last_open is None or last_open[0] != tag:
                    return Action("invalid")
                content = text[last_open[1]: m.start()].strip()
                if not content:
                    return Action("invalid")
                if tag == c.answer_tag:
                    return Action("answer", content)
                query = self._truncate(content, c.max_query_tokens)
                return Action("search", query) if query else Action("invalid")
            last_open = None if closing else (tag, m.end())
        return Action("invalid")

    # ---- replies ------------------------------------------------------------------------------
    def observation(self, passages: list[Passage]) -> str:
        """The reply to a search: the passages in the observation template, within the token budget.

        Over budget, the docs text is cut at the end (the template's closing tag is always kept).
        """
        c = self.config
        docs = "".join(
            c.doc_template.format(index=i + 1, title=p.title, text=p.text, id=p.id)
            for i, p in enumerate(passages)
        )
        if c.strip_docs:
            docs = docs.strip()
        obs = c.observation_template.format(tag=c.information_tag, docs=docs)
        excess = self._count(obs) - c.max_observation_tokens
        doc_ids = self.tokenizer.encode(docs, add_special_tokens=False)
        keep = len(doc_ids)
        while excess > 0:  # re-tokenising the cut text can merge tokens differently; shrink until it fits
            keep = max(0, keep - excess)
            cut = self.tokenizer.decode(doc_ids[:keep])
            obs = c.observation_template.format(tag=c.information_tag, docs=cut)
            excess = self._count(obs) - c.max_observation_tokens
        return obs

    def reply(self, action: Action, passages: list[Passage] | None, last_search_turn: bool) -> str:
        """The environment's text after a non-final turn that did not answer.

        Args:
            action: the parsed turn (``search`` or ``invalid``).
            passages: what the search returned (``search`` only).
            last_search_turn: the turn was turn ``max_turns``; the reply then ends with the final notice.
        """
        if action.kind == "search":
            if passages is None:
                raise ValueError("SearchEnv.reply: a search action needs the passages it retrieved")
            text = self.observation(passages)
        elif action.kind == "invalid":
            text = self.invalid_message
        else:
            raise ValueError(f"SearchEnv.reply: an {action.kind!r} action ends the episode; nothing to reply")
        return text + self.final_notice if last_search_turn else text

    # ---- token budgets ------------------------------------------------------------------------
    def _count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _truncate(self, text: str, budget: int) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= budget else self.tokenizer.decode(ids[:budget]).strip()
