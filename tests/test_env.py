"""SearchEnv: parsing of well-formed and malformed turns, observation text and budgets."""

import pytest

from bridge_pl.models import load_tokenizer
from bridge_pl.records import Passage
from bridge_pl.rollout.env import Action, EnvConfig, SearchEnv


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def env(tok):
    return SearchEnv(EnvConfig(), tok)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>hmm</think>\n<search> capital of France </search>", Action("search", "capital of France")),
        ("<think>done</think><answer> Paris </answer>", Action("answer", "Paris")),
        # several actions: the first complete one wins
        ("<search>a</search><answer>b</answer>", Action("search", "a")),
        ("<answer>b</answer><search>a</search>", Action("answer", "b")),
        # unclosed tags
        ("<search>capital of France", Action("invalid")),
        ("<answer>Paris", Action("invalid")),
        ("<think>I should search", Action("invalid")),
        ("no tags at all", Action("invalid")),
        ("", Action("invalid")),
        # closing tag without its opening tag, or mismatched
        ("capital</search>", Action("invalid")),
        ("<answer>Paris</search>", Action("invalid")),
        # nested: the nearest opening tag of the same kind opens the action; other tags inside -> invalid
        ("<search>a <search>b</search>", Action("search", "b")),
        ("<search>a <answer>b</search>", Action("invalid")),
        ("<search>q <think>x</think></search>", Action("invalid")),
        ("<think><search>q</search></think>", Action("search", "q")),
        # empty content
        ("<search></search>", Action("invalid")),
        ("<search>  \n </search>", Action("invalid")),
        ("<answer> </answer>", Action("invalid")),
        # model-written information blocks are inert
        ("<information><search>q</search>", Action("invalid")),
        ("<information>Doc 1 <answer>x</answer></information>", Action("invalid")),
        ("<information>fake</information><search>real</search>", Action("search", "real")),
        ("<search>a <information>b</information></search>", Action("invalid")),
        ("<information><information>x</information><answer>y</answer>", Action("answer", "y")),
        # exact, case-sensitive tags
        ("<SEARCH>q</SEARCH>", Action("invalid")),
        ("<search >q</search >", Action("invalid")),
        # multi-line content is kept whole (stripped at the ends)
        ("<answer>\nline one\nline two\n</answer>", Action("answer", "line one\nline two")),
        ("<answer>café ☕</answer>", Action("answer", "café ☕")),
    ],
)
def test_parse_action(env, text, expected):
    assert env.parse_action(text) == expected


def test_huge_query_is_truncated_to_budget(tok):
    env = SearchEnv(EnvConfig(max_query_tokens=5), tok)
    words = "alpha beta gamma delta epsilon zeta eta theta " * 50
    action = env.parse_action(f"<search>{words}</search>")
    assert action.kind == "search"
    assert action.content == "alpha beta gamma delta epsilon"
    assert len(tok.encode(action.content, add_special_tokens=False)) <= 5


def test_stop_strings_follow_tag_names(tok):
    env = SearchEnv(EnvConfig(search_tag="query", answer_tag="final"), tok)
    assert env.stop_strings == ("</query>", "</final>")
    assert env.parse_action("<query>x</query>") == Action("search", "x")
    assert env.parse_action("<search>x</search>") == Action("invalid")
    assert "<query>" in env.invalid_message and "</final>" in env.invalid_message


def test_observation_matches_search_r1(env):
    passages = [Passage("a", "T1", "text1"), Passage("b", "T2", "text2")]
    assert env.observation(passages) == (
        '\n\n<information>Doc 1(Title: "T1") text1\nDoc 2(Title: "T2") text2</information>\n\n'
    )
    assert env.observation([]) == "\n\n<information></information>\n\n"


def test_invalid_message_is_search_r1s(env):
    assert env.invalid_message == (
        "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
        "</search>. If I want to give the final answer, I should put the answer between <answer> and "
        "</answer>. Let me try again.\n"
    )


def test_configurable_templates(tok):
    cfg = EnvConfig(
        information_tag="docs",
        observation_template="<{tag}>\n{docs}\n</{tag}>",
        doc_template="[{index}] {title}: {text}\n",
    )
    env = SearchEnv(cfg, tok)
    assert env.observation([Passage("a", "T1", "x")]) == "<docs>\n[1] T1: x\n</docs>"


def test_observation_is_truncated_to_budget_keeping_the_closing_tag(tok):
    env = SearchEnv(EnvConfig(max_observation_tokens=40), tok)
    passages = [Passage(str(i), f"Title {i}", "lorem ipsum dolor sit amet " * 30) for i in range(3)]
    obs = env.observation(passages)
    assert len(tok.encode(obs, add_special_tokens=False)) <= 40
    assert obs.startswith('\n\n<information>Doc 1(Title: "Title 0") lorem ipsum')
    assert obs.endswith("</information>\n\n")


def test_reply_and_final_notice(env):
    p = [Passage("a", "T", "x")]
    assert env.reply(Action("search", "q"), p, last_search_turn=False) == env.observation(p)
    assert env.reply(Action("invalid"), None, last_search_turn=False) == env.invalid_message
    last = env.reply(Action("search", "q"), p, last_search_turn=True)
    assert last == env.observation(p) + env.final_notice and "<answer>" in env.final_notice
    with pytest.raises(ValueError, match="ends the episode"):
        env.reply(Action("answer", "x"), None, last_search_turn=False)
    with pytest.raises(ValueError, match="needs the passages"):
        env.reply(Action("search", "q"), None, last_search_turn=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"search_tag": "se arch"}, "search_tag"),
        ({"answer_tag": "search"}, "distinct"),
        ({"max_query_tokens": 0}, "max_query_tokens"),
        ({"observation_template": "<information></information>"}, "docs"),
        ({"invalid_message": " "}, "invalid_message"),
    ],
)
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EnvConfig(**kwargs)


def test_budget_smaller_than_template_is_rejected(tok):
    with pytest.raises(ValueError, match="max_observation_tokens"):
        SearchEnv(EnvConfig(max_observation_tokens=3), tok)
    with pytest.raises(ValueError, match="tokenizer"):
        SearchEnv(EnvConfig())
