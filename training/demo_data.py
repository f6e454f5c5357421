"""Prompts for distilling `kvfree-demo`, the embedded default model: three skills, generated offline and reproducibly.

- **chat**: short requests in ChatML (the teacher writes the replies);
- **tools**: a function schema in the system prompt (rendered by the chat template's `tools`), a user request that
  calls for it, and the expected call (`{"name", "arguments"}`) to score a reply against; the schemas are built
  from a bank of domains and actions, and a fixed fifth of them is held out for evaluation;
- **recall**: facts stated early in a conversation (a name, a number, a place, a code word), unrelated filler
  turns (up to `max_filler_turns`, most of them short, a tail of long ones), then a question whose answer is one fact;
- **text**: the opening words of a story or an essay, plain text without the chat template (the teacher continues
  it), so that `kvfree generate` continues prose.

Every example comes from `random.Random(seed)` alone (same seed, same examples, in any process), and the
evaluation split never shares a tool schema or a fact value with the training split: `split="eval"` draws fact
values from banks the training split never uses. `python -m kvfree.training.demo_data --split train --n 5` prints
examples as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Split = Literal["train", "eval"]

# -- tool schemas ------------------------------------------------------------------------------------------------------

# (domain, noun the user talks about, parameters: name -> (JSON type, description, example values))
_DOMAINS: list[tuple[str, str, dict[str, tuple[str, str, list[Any]]]]] = [
    ("weather", "the weather", {"city": ("string", "City name", ["Paris", "Lima", "Oslo", "Cairo", "Hanoi"]),
                                "unit": ("string", "celsius or fahrenheit", ["celsius", "fahrenheit"])}),
    ("flight", "flights", {"origin": ("string", "Departure city", ["Rome", "Tokyo", "Austin", "Dakar"]),
                           "destination": ("string", "Arrival city", ["Berlin", "Quito", "Perth", "Seoul"]),
                           "date": ("string", "Date, YYYY-MM-DD", ["2026-03-14", "2026-07-01", "2026-12-24"])}),
    ("hotel", "a hotel", {"city": ("string", "City name", ["Lisbon", "Denver", "Kyoto", "Accra"]),
                          "nights": ("integer", "Number of nights", [1, 2, 3, 5, 7])}),
    ("stock", "a stock price", {"ticker": ("string", "Ticker symbol", ["ACME", "GLOBX", "INITECH", "UMBR"])}),
    ("currency", "a currency conversion", {"amount": ("number", "Amount to convert", [10, 25.5, 100, 999.99]),
                                           "from_currency": ("string", "ISO code", ["USD", "EUR", "JPY"]),
                                           "to_currency": ("string", "ISO code", ["GBP", "CHF", "INR"])}),
    ("recipe", "a recipe", {"dish": ("string", "Dish name", ["lasagna", "pho", "falafel", "paella"]),
                            "servings": ("integer", "Servings", [2, 4, 6])}),
    ("movie", "movie showtimes", {"title": ("string", "Movie title", ["Solaris", "Arrival", "Heat"]),
                                  "city": ("string", "City name", ["Madrid", "Toronto", "Nairobi"])}),
    ("translation", "a translation", {"text": ("string", "Text to translate", ["good morning", "thank you"]),
                                      "target_language": ("string", "Language", ["French", "Swahili", "Korean"])}),
    ("timer", "a timer", {"minutes": ("integer", "Duration in minutes", [3, 10, 25, 45])}),
    ("email", "an email", {"to": ("string", "Recipient address", ["ana@example.com", "li@example.org"]),
                           "subject": ("string", "Subject line", ["Lunch", "Invoice", "Trip"])}),
    ("package", "a package", {"tracking_number": ("string", "Tracking number", ["1Z999AA1", "RX123456"])}),
    ("restaurant", "a restaurant table", {"restaurant": ("string", "Name", ["Blue Door", "Casa Luna"]),
                                          "people": ("integer", "Party size", [2, 3, 4, 8]),
                                          "time": ("string", "Time, HH:MM", ["19:00", "20:30", "12:15"])}),
    ("calendar", "a calendar event", {"title": ("string", "Event title", ["Dentist", "Standup", "Yoga"]),
                                      "date": ("string", "Date, YYYY-MM-DD", ["2026-05-02", "2026-09-18"])}),
    ("music", "a song", {"song": ("string", "Song title", ["Clair de Lune", "Blue in Green"]),
                         "artist": ("string", "Artist", ["Debussy", "Miles Davis"])}),
]  # fmt: skip

# (function-name pattern, what the user asks for, which parameters the call takes: all or the first one)
_ACTIONS: list[tuple[str, str, Literal["all", "first"]]] = [
    ("get_{d}", "Can you get me {noun} for {args}?", "all"),
    ("search_{d}", "Please search {noun} with {args}.", "all"),
    ("check_{d}", "Check {noun}: {args}.", "first"),
]

HELD_OUT_EVERY = 5  # every fifth schema (by index) is for evaluation only


@dataclass(frozen=True)
class ToolSchema:
    """One function in OpenAI's tool format, and how users ask for it."""

    name: str
    description: str
    parameters: dict[str, Any]
    ask: str  # the request template: {noun} and {args}
    noun: str
    examples: dict[str, list[Any]]  # example values per parameter

    def tool(self) -> dict[str, Any]:
        """As `tools` take it: `{"type": "function", "function": {...}}`."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


def tool_schemas() -> list[ToolSchema]:
    """Every schema, in a fixed order (domains x actions)."""
    out = []
    for domain, noun, params in _DOMAINS:
        for pattern, ask, which in _ACTIONS:
            names = list(params) if which == "all" else list(params)[:1]
            properties = {p: {"type": params[p][0], "description": params[p][1]} for p in names}
            out.append(
                ToolSchema(
                    name=pattern.format(d=domain),
                    description=f"{pattern.split('_')[0].capitalize()} {noun}.",
                    parameters={"type": "object", "properties": properties, "required": names},
                    ask=ask,
                    noun=noun,
                    examples={p: params[p][2] for p in names},
                )
            )
    return out


def schemas_for(split: Split) -> list[ToolSchema]:
    """The schemas of a split: evaluation has every `HELD_OUT_EVERY`-th one, training the rest."""
    held = [i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for i in range(len(tool_schemas()))]
    return [s for s, h in zip(tool_schemas(), held, strict=True) if h == (split == "eval")]


# -- fact banks --------------------------------------------------------------------------------------------------------

# Training answers are made up from syllables and digits, thousands of them, so that the only way to answer is to
# copy the fact from the conversation (a small bank would be memorised, and held-out values never produced).
_SYLLABLES = ["ba", "ko", "ri", "mel", "dan", "su", "ta", "vo", "lin", "ne", "por", "ga", "zu", "fi", "ram", "te",
              "lo", "shi", "ber", "ca", "mon", "de", "ya", "kel"]  # fmt: skip


def _made_up_word(rng: random.Random, capital: bool) -> str:
    word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
    return word.capitalize() if capital else word


_TRAIN_VALUES = {
    "name": lambda rng: _made_up_word(rng, True),
    "number": lambda rng: str(rng.randint(1, 99)),
    "word": lambda rng: _made_up_word(rng, False),
    "gate": lambda rng: rng.choice("ABCDEFGHKLMNPRST") + str(rng.randint(1, 40)),
    "place": lambda rng: _made_up_word(rng, True),
}

# (the fact as stated, the question, the answer as a sentence, the kind of value, the evaluation values)
_FACTS: list[tuple[str, str, str, str, list[str]]] = [
    ("My sister's name is {v}.", "What is my sister's name?", "Your sister's name is {v}.", "name",
     ["Greta", "Omar", "Lucia", "Ravi", "Noor"]),
    ("I parked on level {v}.", "Which level did I park on?", "You parked on level {v}.", "number",
     ["104", "116", "128", "135", "142"]),
    ("The code word for today is {v}.", "What is the code word for today?", "Today's code word is {v}.", "word",
     ["saffron", "quartz", "willow", "ember", "tundra"]),
    ("My flight leaves from gate {v}.", "Which gate does my flight leave from?", "It leaves from gate {v}.", "gate",
     ["F53", "G64", "H76", "K81", "M98"]),
    ("I was born in {v}.", "Where was I born?", "You were born in {v}.", "place",
     ["Split", "Fez", "Hobart", "Bergen", "Leon"]),
]  # fmt: skip
_EVAL_VALUES = {v.lower() for fact in _FACTS for v in fact[4]}


def fact_value(rng: random.Random, kind: str, split: Split, eval_values: list[str]) -> str:
    """An answer: one of the fact's evaluation values, or for training a made-up one that is none of them."""
    if split == "eval":
        return rng.choice(eval_values)
    while (value := _TRAIN_VALUES[kind](rng)).lower() in _EVAL_VALUES:
        pass
    return value


FILLER = [
    ("What is a good name for a cat?", "Maybe Pepper or Miso."),
    ("Tell me a fun fact about octopuses.", "An octopus has three hearts."),
    ("How do I boil an egg?", "Put it in boiling water for about nine minutes."),
    ("Suggest a weekend hobby.", "Try sketching outdoors."),
    ("What rhymes with moon?", "Spoon, tune and dune."),
    ("Give me a word for happy.", "Cheerful."),
    ("Why is the sky blue?", "Air scatters blue light more than red light."),
    ("Name a prime number above twenty.", "Twenty-three."),
]

_CHAT = [
    "Write a haiku about {topic}.",
    "Explain {topic} to a child in two sentences.",
    "Give me three tips about {topic}.",
    "What is one surprising fact about {topic}?",
    "Summarise what {topic} is in one sentence.",
]
_TOPICS = ["rain", "bridges", "honey bees", "volcanoes", "chess", "the moon", "bread", "trains", "coral reefs", "ink",
           "clouds", "libraries", "bicycles", "tea", "maps", "owls", "glaciers", "music", "gardens", "lighthouses",
           "deserts", "kites", "rivers", "penguins", "cheese", "clocks", "forests", "paper", "the ocean", "snow"]
_CHAT += [
    "Write a short poem about {topic}.",
    "Why do people like {topic}?",
    "Tell me a very short story about {topic}.",
    "List two facts about {topic}.",
    "Describe {topic} in three words.",
]

# Openers for plain-text continuation: (subject, what happens); the evaluation split uses its own subjects.
_TEXT_OPENERS = ["Once upon a time", "Long ago, in a small village,", "The old man looked at", "Every morning,",
                 "In the beginning", "It was a cold night when", "The history of", "My favourite place is",
                 "Scientists have found that", "The little girl wanted"]
_TEXT_SUBJECTS_TRAIN = ["a fox", "the baker", "a young sailor", "the king", "a robot", "two friends", "the teacher",
                        "a lonely dragon", "the farmer", "a curious cat", "the river", "a painter"]
_TEXT_SUBJECTS_EVAL = ["a shy giant", "the astronomer", "a tiny mouse", "the fisherman", "a clockmaker"]


# -- examples ----------------------------------------------------------------------------------------------------------


@dataclass
class Example:
    """One prompt: the conversation so far (ChatML messages), the tools shown, and what a right reply contains.

    skill: "chat", "tools" or "recall". expected: for tools the call `{"name", "arguments"}`, for recall the answer
    string, for chat None (the teacher's reply is the target). filler_turns: for recall, how many unrelated
    exchanges sit between the fact and the question. answer: for recall, the answer as a sentence.
    """

    skill: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    expected: Any = None
    filler_turns: int = 0
    schema: dict[str, Any] | None = field(default=None, repr=False)  # the called function's parameters (tools)
    answer: str | None = None


def _args_text(args: dict[str, Any]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in args.items())


def tool_example(rng: random.Random, split: Split) -> Example:
    schema = rng.choice(schemas_for(split))
    args = {p: rng.choice(values) for p, values in schema.examples.items()}
    others = [s for s in schemas_for(split) if s.name != schema.name]
    shown = [schema, *rng.sample(others, k=min(2, len(others)))]  # the model must pick the right one
    rng.shuffle(shown)
    request = schema.ask.format(noun=schema.noun, args=_args_text(args))
    return Example(
        skill="tools",
        messages=[
            {"role": "system", "content": "You are a helpful assistant with tools. Call a tool when one fits."},
            {"role": "user", "content": request},
        ],
        tools=[s.tool() for s in shown],
        expected={"name": schema.name, "arguments": args},
        schema=schema.parameters,
    )


def recall_example(rng: random.Random, split: Split, filler_turns: int) -> Example:
    statement, question, sentence, kind, eval_values = rng.choice(_FACTS)
    answer = fact_value(rng, kind, split, eval_values)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant. Remember what the user tells you."},
        {"role": "user", "content": statement.format(v=answer)},
        {"role": "assistant", "content": "Got it, I will remember that."},
    ]
    for _ in range(filler_turns):
        ask, reply = rng.choice(FILLER)
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": question})
    return Example(skill="recall", messages=messages, expected=answer, filler_turns=filler_turns,
                   answer=sentence.format(v=answer))  # fmt: skip


def text_example(rng: random.Random, split: Split) -> Example:
    """A plain-text opener (no chat template): `messages` holds it as one user message's content for the record;
    training encodes the text itself."""
    subjects = _TEXT_SUBJECTS_EVAL if split == "eval" else _TEXT_SUBJECTS_TRAIN
    opener = f"{rng.choice(_TEXT_OPENERS)} {rng.choice(subjects)}"
    return Example(skill="text", messages=[{"role": "user", "content": opener}])


def filler_turns(rng: random.Random, most: int) -> int:
    """How many filler exchanges a recall example gets: uniform up to 8 half the time, else log-uniform up to `most`
    (short conversations teach the task, long ones teach holding the fact across many tokens)."""
    if most <= 8 or rng.random() < 0.5:
        return rng.randint(0, min(8, most))
    return min(most, int(round(8 * (most / 8) ** rng.random())))


def chat_example(rng: random.Random) -> Example:
    request = rng.choice(_CHAT).format(topic=rng.choice(_TOPICS))
    return Example(skill="chat", messages=[{"role": "user", "content": request}])


def target_reply(
    example: Example, tool_call_start: str = "<tool_call>", tool_call_end: str = "</tool_call>"
) -> str | None:
    """The reply to train toward where the right one is known: a tools example's call, written as the checkpoint's
    tool-call format declares (`{"name": ..., "arguments": {...}}` between its tags), a recall example's answer as a
    sentence; None for chat, whose reply the teacher writes."""
    if example.skill == "tools":
        return tool_call_start + json.dumps(example.expected, ensure_ascii=False) + tool_call_end
    if example.skill == "recall":
        return example.answer
    return None


SKILLS = ("chat", "tools", "recall", "text")


def examples(split: Split, seed: int, n: int, skills: tuple[str, ...] = SKILLS,
             max_filler_turns: int = 96) -> list[Example]:  # fmt: skip
    """`n` examples of `split`, cycling through `skills`; the same for the same arguments in any process."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"kvfree-demo/{split}/{seed}")
    out = []
    for i in range(n):
        skill = skills[i % len(skills)]
        if skill == "tools":
            out.append(tool_example(rng, split))
        elif skill == "recall":
            out.append(recall_example(rng, split, filler_turns(rng, max_filler_turns)))
        elif skill == "text":
            out.append(text_example(rng, split))
        elif skill == "chat":
            out.append(chat_example(rng))
        else:
            raise ValueError(f"unknown skill {skill!r}; expected one of {SKILLS}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print kvfree-demo training or evaluation prompts as JSON lines.")
    ap.add_argument("--split", choices=["train", "eval"], default="train")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=6)
    a = ap.parse_args(argv)
    for ex in examples(a.split, a.seed, a.n):
        print(json.dumps(asdict(ex), ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
