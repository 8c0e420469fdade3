"""The built-in synthetic world: a seeded encyclopedia of fictional entities and questions about it.

Every fact lives only in the world's passages (invented, pronounceable names), so a pretrained LM cannot
answer from memory and must search. Entities: countries (capital, currency), cities (country, river,
founding year), people (birthplace, birth year, profession, mentor, parent) and organisations (founder,
seat, founding year). Like chunked Wikipedia, each entity has several short passages titled with its
name: one lead that states the facts questions ask about, and chunks that state facts about others
(a person's children, death place, career; a city's twin town and fair; an organisation's branch).

Distractors are built in so that an untrained dense retriever is far from perfect but can learn: the
other chunks of the same entity reuse the question's words ("X had a child, Y, who was born in Z"),
some leads paraphrase them away ("A native of Z, X ..."), people share first names and surnames (a
child carries the parent's), cities come in families with a shared stem (Velmar / Velmin), and half the
organisations are named after a city that is not their seat. Untrained all-MiniLM-L6-v2 on dev+test
(seed 0): single-hop recall@1/3/10 = 0.34 / 0.67 / 1.00.

Questions (``metadata["type"]``):

- ``single``: one hop, e.g. "In which city was Zorvan Keldt born?"
- ``bridge``: two hops, e.g. "In which country is the birthplace of Zorvan Keldt?" (person, then city)
- ``comparison``: two passages, e.g. "Who was born earlier, A or B?"; the answer is one of the names.

``metadata`` also holds ``gold_passages`` (per hop, a list of passage ids), ``hops`` (the entity
name per hop) and ``hop_queries`` (per hop, the search query one would issue: the question itself for
the first hop of single/bridge questions, "<entity> <relation>" otherwise). Answers are short strings
(a name, a lowercase currency word or a year) that occur in the last hop's gold passage (for
comparisons: in one of the two gold passages).

With ``mc_share > 0`` that share of the questions (drawn at random, in every split) is multiple choice:
``metadata["options"]`` holds four lettered options drawn from the entities of the gold answer's kind (city,
country, river, currency, person, year; a comparison's two names are both among them), the gold letter is
uniform over the four, ``golden_answers`` is ``[letter]`` and ``metadata["answer_text"]`` the answer itself.
The rest of the world (corpus, questions, free-text answers) is the same as with ``mc_share = 0``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bridge_pl.data.qa import write_corpus, write_qa
from bridge_pl.records import Passage, QAExample
from bridge_pl.seeding import derive_seed

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr",
           "st", "th", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei")
_INNER_CODAS = ("", "", "", "r", "l", "n")  # inside a word: keep syllables light
_CODAS = ("", "n", "r", "l", "s", "m", "th", "nd", "rk", "lt", "x")  # end of a word
_ENDINGS = ("ar", "in", "ora", "ek", "ista", "ovo", "unde", "ath", "elle", "ak")
_NOW = 2024  # no event is dated later
_PROFESSIONS = ("painter", "architect", "composer", "chemist", "sculptor", "poet", "astronomer",
                "engineer", "botanist", "cartographer", "historian", "physician")
MC_SHARE = 0.5  # the share of multiple-choice questions in the named source world-mc/SPLIT
MC_OPTIONS = 4
_ORG_KINDS = {"Society": "learned society", "Guild": "craft guild", "Institute": "research institute",
              "Company": "trading company", "Academy": "school", "Foundation": "charitable foundation"}


class _Namer:
    """Unique invented words. One namer per world, so no word names two entities of different kinds."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()  # membership only; never iterated (keeps the output seed-stable)

    def _syllable(self, final: bool = True) -> str:
        codas = _CODAS if final else _INNER_CODAS
        return self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(codas)

    def _claim(self, make: Callable[[], list[str]]) -> list[str]:
        """Call ``make`` until it returns words that are all new (length >= 4), and reserve them."""
        while True:
            words = [w.capitalize() for w in make()]
            if all(len(w) >= 4 and w not in self.used for w in words) and len(set(words)) == len(words):
                self.used.update(words)
                return words

    def word(self, syllables: int = 2) -> str:
        return self._claim(
            lambda: ["".join(self._syllable(final=i == syllables - 1) for i in range(syllables))]
        )[0]

    def stem_family(self, size: int) -> list[str]:
        """``size`` words sharing a stem, e.g. Velmar, Velmin, Velmora."""

        def make() -> list[str]:
            stem = self._syllable(final=False) + self.rng.choice(_ONSETS)
            return [stem + e for e in self.rng.sample(_ENDINGS, size)]

        return self._claim(make)


@dataclass(frozen=True)
class _Country:
    name: str
    capital: str
    currency: str


@dataclass(frozen=True)
class _City:
    name: str
    country: str
    river: str
    founded: int


@dataclass(frozen=True)
class _Person:
    name: str
    first: str
    last: str
    born_in: str
    year: int
    profession: str
    pronoun: str
    works_in: str
    parent: str | None  # another person, with the same surname


@dataclass(frozen=True)
class _Org:
    name: str
    kind: str
    founder: str
    city: str
    founded: int


@dataclass
class World:
    """A generated world: the corpus and three question splits with disjoint question texts."""

    corpus: list[Passage]
    train: list[QAExample]
    dev: list[QAExample]
    test: list[QAExample]
    seed: int = 0


@dataclass(frozen=True)
class _Q:
    """A question before ids are assigned; gold passages are given as passage keys (see _Passages)."""

    type: str
    question: str
    answer: str
    gold: tuple[str, ...]
    hops: tuple[str, ...]
    hop_queries: tuple[str, ...]


def _entities(rng: random.Random, n_countries: int, n_cities: int, n_people: int, n_orgs: int):
    namer = _Namer(rng)
    if n_cities < 3:
        raise ValueError(f"n_cities must be >= 3, got {n_cities}")
    rivers = [namer.word() for _ in range(max(2, n_cities // 4))]
    city_names: list[str] = []
    while len(city_names) < n_cities:
        city_names += namer.stem_family(min(rng.choice((2, 3)), n_cities - len(city_names)))
    rng.shuffle(city_names)
    country_names = [namer.word(rng.choice((2, 3))) for _ in range(n_countries)]
    # The first cities go round-robin so that every country has at least one city (its capital).
    cities = [
        _City(name, country_names[i] if i < n_countries else rng.choice(country_names),
              rng.choice(rivers), rng.randrange(900, 1800))
        for i, name in enumerate(city_names)
    ]
    countries = [
        _Country(name, rng.choice([c.name for c in cities if c.country == name]), namer.word().lower())
        for name in country_names
    ]
    # Small name pools, so that first names and surnames are shared by several people.
    firsts = [namer.word() for _ in range(max(2, n_people // 5))]
    lasts = [namer.word(rng.choice((1, 2))) for _ in range(max(2, n_people // 4))]
    names: set[str] = set()

    def new_name(last: str | None) -> tuple[str, str]:
        while True:
            for _ in range(20):
                first, surname = rng.choice(firsts), last or rng.choice(lasts)
                if f"{first} {surname}" not in names:
                    names.add(f"{first} {surname}")
                    return first, surname
            firsts.append(namer.word())  # pools too small for this many unique names: grow them

    people: list[_Person] = []
    for _ in range(n_people):
        year = rng.randrange(1780, 1960)
        parents = [p for p in people if 22 <= year - p.year <= 45]
        parent = rng.choice(parents) if parents and rng.random() < 0.6 else None
        first, last = new_name(parent.last if parent else None)
        born, works = rng.sample(cities, 2)
        people.append(_Person(f"{first} {last}", first, last, born.name, year, rng.choice(_PROFESSIONS),
                              rng.choice(("He", "She")), works.name, parent.name if parent else None))
    orgs = []
    for founder in rng.sample(people, n_orgs):
        kind = rng.choice(list(_ORG_KINDS))
        # Half the organisations are named after a city other than their seat (a name-sharing distractor).
        namesake = rng.choice([c.name for c in cities if c.name != founder.works_in])
        name = f"{namesake} {kind}"
        if rng.random() < 0.5 or name in {o.name for o in orgs}:
            name = f"{namer.word()} {kind}"
        orgs.append(_Org(name, kind, founder.name, founder.works_in, founder.year + rng.randrange(25, 50)))
    # The two children named in each person's family passages: real children first, then children who
    # have no passage of their own (names reserved, so no two people share one).
    family: dict[str, list[_Person]] = {p.name: [] for p in people}
    for p in people:
        if p.parent is not None and len(family[p.parent]) < 2:
            family[p.parent].append(p)
    for p in people:
        while len(family[p.name]) < 2:
            first, _ = new_name(p.last)
            family[p.name].append(_Person(f"{first} {p.last}", first, p.last, rng.choice(cities).name,
                                          p.year + rng.randrange(22, 40), "", rng.choice(("He", "She")), "",
                                          p.name))
    return countries, cities, people, orgs, family


def _a(noun: str) -> str:
    """``noun`` with its indefinite article."""
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _passages(rng: random.Random, countries, cities, people, orgs, family) -> dict[str, Passage]:
    """Passages keyed by ``"<kind>:<entity>"``; ids are assigned later, after shuffling.

    ``country:``, ``city:``, ``bio:`` and ``org:`` passages state the facts that questions ask about.
    The other chunks share the entity's title and the question's words but state facts about others
    (a twin city, a child, a branch office): the hard negatives.
    """
    out: dict[str, Passage] = {}

    def add(key: str, title: str, *variants: str) -> None:
        out[key] = Passage(id="", title=title, text=rng.choice(variants))

    for c in countries:
        add(f"country:{c.name}", c.name,
            f"{c.name} is a country whose capital is {c.capital}. Its currency is the {c.currency}.",
            f"The {c.currency} is the currency of {c.name}, a country with its capital at {c.capital}.")
        port = rng.choice([x.name for x in cities if x.country == c.name])
        other = rng.choice([x for x in countries if x is not c] or [c])
        add(f"country-more:{c.name}", c.name,
            f"The largest port of {c.name} is {port}. {c.name} trades with {other.name}, which uses the "
            f"{other.currency}.")
    for c in cities:
        add(f"city:{c.name}", c.name,
            f"{c.name} is a city in {c.country}, on the river {c.river}. It was founded in {c.founded}.",
            f"Founded in {c.founded}, {c.name} is a town of {c.country} lying on the river {c.river}.")
        twin = rng.choice([x for x in cities if x.country != c.country] or [x for x in cities if x is not c])
        add(f"city-more:{c.name}", c.name,
            f"{c.name} is twinned with {twin.name}, a city of {twin.country} on the river {twin.river}. "
            f"Its cathedral was completed in {c.founded + rng.randrange(50, 300)}.")
        add(f"city-fair:{c.name}", c.name,
            f"Every spring {c.name} hosts a fair that draws traders from {rng.choice(countries).name}. "
            f"The city's university was founded in {c.founded + rng.randrange(100, 500)}.")
    founded = {o.founder: o for o in orgs}
    for p in people:
        # Some bios paraphrase "born" away, while family passages say it about someone else: an untrained
        # retriever follows the words, a trained one must learn whose birth the passage states.
        org, mentor = founded.get(p.name), rng.choice([x for x in people if x is not p])
        bio = rng.choice((
            f"{p.name} is {_a(p.profession)} born in {p.born_in} in {p.year}, a pupil of {mentor.name}.",
            f"{p.name} ({p.year}, {p.born_in}) is {_a(p.profession)} who studied under {mentor.name}.",
            f"A native of {p.born_in}, {p.name} ({p.year}) became a well-known {p.profession} after "
            f"studying under {mentor.name}.",
        ))
        add(f"bio:{p.name}", p.name, bio + (f" {p.pronoun} is a child of {p.parent}." if p.parent else ""))
        work = f"{p.name} worked as {_a(p.profession)} in {p.works_in} from {p.year + rng.randrange(20, 30)}"
        add(f"career:{p.name}", p.name,
            work + (f", where {p.pronoun.lower()} founded the {org.name}." if org else "."))
        host, died = rng.choice([x for x in people if x is not p]), min(p.year + rng.randrange(45, 90), _NOW)
        add(f"death:{p.name}", p.name,
            f"{p.name} died in {host.born_in} in {died}, in the house where {host.name} was born.")
        for i, child in enumerate(family[p.name]):
            add(f"family{i}:{p.name}", p.name,
                f"{p.name} had a child, {child.name}, who was born in {child.born_in} in {child.year}.")
    for o in orgs:
        kind = _a(_ORG_KINDS[o.kind])
        add(f"org:{o.name}", o.name,
            f"The {o.name} is {kind} based in {o.city}. It was founded in {o.founded} by {o.founder}.",
            f"Founded by {o.founder} in {o.founded}, the {o.name} is {kind} in {o.city}.")
        branch = rng.choice([c.name for c in cities if c.name != o.city])
        head = rng.choice([p.name for p in people if p.name != o.founder])
        opened, since = (min(o.founded + rng.randrange(lo, hi), _NOW) for lo, hi in ((10, 60), (5, 80)))
        add(f"org-more:{o.name}", o.name,
            f"In {opened} the {o.name} founded a second house in {branch}, led by {head}.")
        add(f"org-archive:{o.name}", o.name,
            f"Since {since} the {o.name} has published a yearbook; its archive is kept in "
            f"{rng.choice(cities).name}.")
    return out


def _single(q: str, answer: str, key: str, entity: str) -> _Q:
    return _Q("single", q, answer, (key,), (entity,), (q,))


def _bridge(q: str, answer: str, keys: tuple[str, str], hops: tuple[str, str], query2: str) -> _Q:
    return _Q("bridge", q, answer, keys, hops, (q, query2))


def _questions(rng: random.Random, countries, cities, people, orgs) -> dict[str, list[_Q]]:
    city = {c.name: c for c in cities}
    country = {c.name: c for c in countries}
    person = {p.name: p for p in people}
    single: list[_Q] = []
    bridge: list[_Q] = []
    for p in people:
        bio, c = f"bio:{p.name}", city[p.born_in]
        single += [
            _single(f"In which city was {p.name} born?", p.born_in, bio, p.name),
            _single(f"In which year was {p.name} born?", str(p.year), bio, p.name),
        ]
        keys, hops = (bio, f"city:{c.name}"), (p.name, c.name)
        bridge += [
            _bridge(f"In which country is the birthplace of {p.name}?", c.country, keys, hops,
                    f"{c.name} country"),
            _bridge(f"On which river lies the city where {p.name} was born?", c.river, keys, hops,
                    f"{c.name} river"),
            _bridge(f"In which year was the birthplace of {p.name} founded?", str(c.founded), keys, hops,
                    f"{c.name} founded"),
        ]
    for c in cities:
        key, k = f"city:{c.name}", country[c.country]
        single += [
            _single(f"In which country is {c.name}?", c.country, key, c.name),
            _single(f"On which river does {c.name} lie?", c.river, key, c.name),
            _single(f"In which year was {c.name} founded?", str(c.founded), key, c.name),
        ]
        keys, hops = (key, f"country:{k.name}"), (c.name, k.name)
        bridge.append(_bridge(f"What is the currency of the country where {c.name} lies?", k.currency,
                              keys, hops, f"{k.name} currency"))
        if k.capital != c.name:
            bridge.append(_bridge(f"What is the capital of the country where {c.name} lies?", k.capital,
                                  keys, hops, f"{k.name} capital"))
    for k in countries:
        key = f"country:{k.name}"
        single += [
            _single(f"What is the capital of {k.name}?", k.capital, key, k.name),
            _single(f"What is the currency of {k.name}?", k.currency, key, k.name),
        ]
    for o in orgs:
        key, f, c = f"org:{o.name}", person[o.founder], city[o.city]
        single += [
            _single(f"Who founded the {o.name}?", o.founder, key, o.name),
            _single(f"In which city is the {o.name} based?", o.city, key, o.name),
            _single(f"In which year was the {o.name} founded?", str(o.founded), key, o.name),
        ]
        keys, hops = (key, f"bio:{f.name}"), (o.name, f.name)
        bridge += [
            _bridge(f"In which city was the founder of the {o.name} born?", f.born_in, keys, hops,
                    f"{f.name} birthplace"),
            _bridge(f"In which year was the founder of the {o.name} born?", str(f.year), keys, hops,
                    f"{f.name} born"),
            _bridge(f"In which country is the city where the {o.name} is based?", c.country,
                    (key, f"city:{c.name}"), (o.name, c.name), f"{c.name} country"),
        ]
    return {"single": single, "bridge": bridge, "comparison": _comparisons(rng, cities, people)}


def _comparisons(rng: random.Random, cities, people) -> list[_Q]:
    """Every unordered pair at most once; half the people pairs share a first name or surname."""
    out: dict[frozenset[str], _Q] = {}
    by_name: dict[str, list[_Person]] = {}
    for p in people:
        by_name.setdefault(p.first, []).append(p)
        by_name.setdefault(p.last, []).append(p)
    groups = [g for g in by_name.values() if len(g) > 1]
    for _ in range(2 * len(people)):
        a, b = rng.sample(rng.choice(groups), 2) if rng.random() < 0.5 and groups else rng.sample(people, 2)
        if a.year != b.year and frozenset((a.name, b.name)) not in out:
            out[frozenset((a.name, b.name))] = _Q(
                "comparison", f"Who was born earlier, {a.name} or {b.name}?",
                a.name if a.year < b.year else b.name, (f"bio:{a.name}", f"bio:{b.name}"),
                (a.name, b.name), (f"{a.name} born", f"{b.name} born"))
    for _ in range(len(cities)):
        a, b = rng.sample(cities, 2)
        if a.founded != b.founded and frozenset((a.name, b.name)) not in out:
            out[frozenset((a.name, b.name))] = _Q(
                "comparison", f"Which city was founded earlier, {a.name} or {b.name}?",
                a.name if a.founded < b.founded else b.name, (f"city:{a.name}", f"city:{b.name}"),
                (a.name, b.name), (f"{a.name} founded", f"{b.name} founded"))
    return list(out.values())


def _answer_pools(countries, cities, people, pools: dict[str, list[_Q]]) -> dict[str, list[str]]:
    """Every answer a multiple-choice option may show, by kind (sorted, so the draw is seed-stable)."""
    years = {q.answer for qs in pools.values() for q in qs if q.answer.isdigit()}
    return {
        "country": sorted(c.name for c in countries), "currency": sorted(c.currency for c in countries),
        "city": sorted(c.name for c in cities), "river": sorted({c.river for c in cities}),
        "person": sorted(p.name for p in people), "year": sorted(years),
    }


def _as_choice(example: QAExample, pools: dict[str, list[str]], rng: random.Random) -> QAExample:
    """``example`` as a multiple-choice question: the gold among ``MC_OPTIONS`` options of its kind, at a
    uniformly drawn letter (a comparison keeps both compared names among the options)."""
    gold = example.golden_answers[0]
    pool = next(p for p in pools.values() if gold in p)
    kept = [h for h in example.metadata["hops"] if h != gold] if example.metadata["type"] == "comparison" else []
    others = [x for x in pool if x != gold and x not in kept]
    wrong = kept + rng.sample(others, MC_OPTIONS - 1 - len(kept))
    rng.shuffle(wrong)
    wrong.insert(rng.randrange(MC_OPTIONS), gold)
    options = {chr(ord("A") + i): text for i, text in enumerate(wrong)}
    letter = next(k for k, v in options.items() if v == gold)
    return QAExample(example.id, example.question, [letter],
                     {**example.metadata, "options": options, "answer_text": gold})


def build_world(
    seed: int = 0,
    n_people: int = 300,
    n_cities: int = 48,
    n_countries: int = 10,
    n_orgs: int = 60,
    n_single: int = 800,
    n_bridge: int = 800,
    n_comparison: int = 400,
    n_dev: int = 150,
    n_test: int = 150,
    mc_share: float = 0.0,
) -> World:
    """Generate a world from ``seed`` (``random.Random(seed)`` only; same seed -> same world).

    ``n_single`` / ``n_bridge`` / ``n_comparison`` cap how many questions of each type are drawn (fewer
    if the entities do not yield that many). The drawn questions are shuffled; the first ``n_dev`` form
    dev, the next ``n_test`` test, the rest train. Question texts are unique, so splits never share one.
    The defaults give ~1,840 passages and 2,000 questions (1,700 train) in well under a second.
    ``mc_share`` of the questions are multiple choice (see the module docstring), drawn from their own random
    stream, so everything else is as with ``mc_share=0``.
    """
    if not 0.0 <= mc_share <= 1.0:
        raise ValueError(f"build_world: mc_share must be in [0, 1], got {mc_share}")
    if n_countries < 1 or n_cities < max(2, n_countries) or n_people < 2 or not 0 <= n_orgs <= n_people:
        raise ValueError(
            "build_world needs n_countries >= 1, n_cities >= max(2, n_countries), n_people >= 2 and "
            f"0 <= n_orgs <= n_people; got n_countries={n_countries}, n_cities={n_cities}, "
            f"n_people={n_people}, n_orgs={n_orgs}"
        )
    rng = random.Random(seed)
    entities = _entities(rng, n_countries, n_cities, n_people, n_orgs)
    by_key = _passages(rng, *entities)
    keys = list(by_key)
    rng.shuffle(keys)  # so that passage ids carry no hint of entity kind or of the gold passage
    ids = {key: f"w{i:05d}" for i, key in enumerate(keys)}
    corpus = [Passage(ids[k], by_key[k].title, by_key[k].text) for k in keys]

    pools = _questions(rng, *entities[:4])
    drawn: list[_Q] = []
    for kind, cap in (("single", n_single), ("bridge", n_bridge), ("comparison", n_comparison)):
        drawn += rng.sample(pools[kind], min(cap, len(pools[kind])))
    rng.shuffle(drawn)
    examples = [
        QAExample(
            id=f"q{i:05d}", question=q.question, golden_answers=[q.answer],
            metadata={"type": q.type, "hops": list(q.hops), "gold_passages": [[ids[k]] for k in q.gold],
                      "hop_queries": list(q.hop_queries)},
        )
        for i, q in enumerate(drawn)
    ]
    if mc_share > 0:
        answers = _answer_pools(*entities[:3], pools)
        choice_rng = random.Random(derive_seed(seed, "multiple_choice"))
        examples = [_as_choice(ex, answers, choice_rng) if choice_rng.random() < mc_share else ex
                    for ex in examples]
    return World(corpus, train=examples[n_dev + n_test:], dev=examples[:n_dev],
                 test=examples[n_dev:n_dev + n_test], seed=seed)


def hop_probes(examples: list[QAExample]) -> dict[str, list[tuple[str, str]]]:
    """The retrieval each hop of the world's questions needs: probe name -> ``(query, gold passage id)`` pairs.

    Probes: ``single`` (the question -> its passage), ``bridge hop 1`` / ``hop 2`` (the question -> the first
    entity's passage; the follow-up query, e.g. "<city> country" -> the second's) and ``comparison hop 1`` /
    ``hop 2`` ("<name> born" / "<name> founded" -> each compared entity's passage). Queries are the ones stored
    in ``metadata["hop_queries"]``, not the policy's, so the retriever's recall is measured on its own.
    """
    rows: dict[str, list[tuple[str, str]]] = {"single": [], "bridge hop 1": [], "bridge hop 2": [],
                                               "comparison hop 1": [], "comparison hop 2": []}
    for ex in examples:
        kind, gold, queries = ex.metadata["type"], ex.metadata["gold_passages"], ex.metadata["hop_queries"]
        if kind == "single":
            rows["single"].append((queries[0], gold[0][0]))
        else:
            for hop in (0, 1):
                rows[f"{kind} hop {hop + 1}"].append((queries[hop], gold[hop][0]))
    return rows


def write_world(out_dir: str | Path, seed: int = 0, **sizes: int) -> dict[str, Path]:
    """Build a world and write ``corpus.jsonl``, ``train.jsonl``, ``dev.jsonl``, ``test.jsonl`` into
    ``out_dir``; ``sizes`` are :func:`build_world`'s keyword sizes. Returns ``{name: path}``.
    """
    world = build_world(seed, **sizes)
    out = Path(out_dir)
    paths = {"corpus": write_corpus(out / "corpus.jsonl", world.corpus)}
    for split in ("train", "dev", "test"):
        paths[split] = write_qa(out / f"{split}.jsonl", getattr(world, split))
    return paths
