"""Prompt templates and the token ids of a question's prompt."""

from __future__ import annotations

from dataclasses import dataclass, field

from bridge_pl.rollout.env import EnvConfig

# {think}, {search}, {information}, {answer}: the env's tag names (data.env); {question}: the question.
INSTRUCTION = (
    "Answer the question. Think step by step inside <{think}> and </{think}>. Whenever you are missing a fact, "
    "search for it by writing <{search}> query </{search}>; the search results will be shown between "
    "<{information}> and </{information}>. You may search several times. When you know the answer, write it "
    "inside <{answer}> and </{answer}> with no explanation, for example <{answer}> Paris </{answer}>.\n"
    "Question: {question}\n"
)
# The same for a multiple-choice question; {options}: one "A. text" line per option.
CHOICE_INSTRUCTION = (
    "Answer the multiple-choice question. Think step by step inside <{think}> and </{think}>. Whenever you are "
    "missing a fact, search for it by writing <{search}> query </{search}>; the search results will be shown "
    "between <{information}> and </{information}>. You may search several times. When you know the answer, "
    "write the correct option inside <{answer}> and </{answer}> with no explanation: its letter, for example "
    "<{answer}>C</{answer}>, or its text.\n"
    "Question: {question}\n"
    "Options:\n{options}\n"
)
_TEMPLATE_FIELDS = ("question", "think", "search", "information", "answer")


def options_text(options: dict[str, str]) -> str:
    """The options as the prompt shows them: ``"A. text"`` lines."""
    return "\n".join(f"{letter}. {text}" for letter, text in options.items())


def template_problem(template: str, extra: tuple[str, ...] = ()) -> str | None:
    """What ``template`` must be and is not (it must hold ``{question}`` and each of ``extra``, and no placeholder
    but the env's tag names, ``{question}`` and ``extra``), or None when it is usable."""
    names = (*_TEMPLATE_FIELDS, *extra)
    required = ("question", *extra)
    if missing := [name for name in required if "{" + name + "}" not in template]:
        return "a template containing " + " and ".join(f"'{{{name}}}'" for name in missing)
    try:
        template.format(**{name: name for name in names})
    except (KeyError, IndexError, ValueError) as error:
        detail = f"unknown placeholder {{{error.args[0]}}}" if isinstance(error, (KeyError, IndexError)) else error
        placeholders = ", ".join("{" + name + "}" for name in names)
        return (f"a template whose only placeholders are {placeholders} (write a literal brace as {{{{ or }}}}); "
                f"{detail}")
    return None


@dataclass(frozen=True)
class PromptBuilder:
    """Builds a question's prompt from the templates: ``instruction`` for free-text questions, ``choice_instruction``
    for multiple-choice ones, the env's tag names filled in, wrapped in the tokenizer's chat template when it has one
    and ``use_chat_template`` is on."""

    instruction: str = INSTRUCTION
    choice_instruction: str = CHOICE_INSTRUCTION
    env: EnvConfig = field(default_factory=EnvConfig)
    use_chat_template: bool = True

    def text(self, question: str, options: dict[str, str] | None = None) -> str:
        """The prompt's text before any chat template; with ``options`` (``{letter: text}``) the multiple-choice
        template, which lists them."""
        tags = self.env.tag_names()
        if options:
            return self.choice_instruction.format(question=question, options=options_text(options), **tags)
        return self.instruction.format(question=question, **tags)

    def ids(self, tokenizer, question: str, options: dict[str, str] | None = None) -> list[int]:
        """Token ids of the prompt for ``question`` (see :meth:`text`)."""
        text = self.text(question, options)
        if self.use_chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer(text)["input_ids"]
