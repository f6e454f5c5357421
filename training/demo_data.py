"""Prompts for distilling `kvfree-demo`, the embedded default model: its skills, made up procedurally and reproducibly.

- **chat**: short requests and questions in ChatML (the teacher writes the replies); a third of them come with tools
  that do not fit the request, so that the model answers in words when no tool applies;
- **text**: the opening words of a story or an essay, plain text without the chat template (the teacher continues it),
  so that `kvfree generate` continues prose;
- **tools**: function schemas made up from word banks (verb x noun names, one to four arguments of every JSON type:
  strings, integers, numbers, booleans, enums, a nested object, optional fields), shown beside distractors that share
  the verb or the noun, and a request that names the function's words and the arguments' values; the target is the
  call. The evaluation split draws its verbs, nouns, argument and object names, enums and result fields from banks
  the training split never uses (no eval function or argument name is ever seen in training), so a held-out schema
  can only be answered by reading the tool list; values are new strings in both splits;
- **tool results** (`tool_turn`): a call, the tool's JSON result, and a final answer that quotes a value of it;
- **recall**: facts stated early in a conversation (values made up afresh: they cannot be memorised), filler turns,
  then questions whose answers are the facts, each answer a target (several per conversation, at growing distance).

Every example comes from `random.Random` seeded by its arguments alone (the same example in any process); training
batches pass a `ValueRandom`, which also carries real words for values.
`python -m kvfree.training.demo_data --split eval --skill tools --n 3` prints examples as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Split = Literal["train", "eval"]
SKILLS = ("chat", "tools", "recall", "text")


def _check_split(split: str) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


# -- values: new in every example, in both splits ---------------------------------------------------------------------
# A value is worth copying only if it cannot be guessed. A first run drew training words from 24 syllables: its
# students learnt to write such words, and answered "Where was I born?" with a made-up one instead of copying "Leon".
# A second, with words of random syllables and letters, copied those but still not a common word ("Leon", "quartz"),
# a kind of value it had never seen. So training values mix made-up words with real ones: a `ValueRandom` carries a
# word list (the training draws it from the tokenizer's vocabulary), and half its words come from there. Held-out
# schemas differ from training ones in their names; their values come from the same generators.
_CONSONANTS = "bcdfghjklmnprstvwxz"
_VOWELS = "aeiouy"


class ValueRandom(random.Random):
    """A `random.Random` that also carries real words for `made_up_word` to draw half its words from."""

    def __init__(self, seed: object, words: list[str]) -> None:
        super().__init__(seed)
        self.words = words


def made_up_word(rng: random.Random, capital: bool = True) -> str:
    """A new word: a real one from `rng.words` half the time when rng is a `ValueRandom`, else one to three
    syllables (consonant, vowel, sometimes a consonant), or a fifth of the time 3-8 random letters."""
    words = getattr(rng, "words", None)
    if words and rng.random() < 0.5:
        word = rng.choice(words)
    elif rng.random() < 0.2:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
    else:
        syllables = [rng.choice(_CONSONANTS) + rng.choice(_VOWELS) + rng.choice(["", "", rng.choice(_CONSONANTS)])
                     for _ in range(rng.randint(1, 3))]  # fmt: skip
        word = "".join(syllables)
    return word[0].upper() + word[1:] if capital else word.lower()


def _code(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(2)) + "-" + str(rng.randint(100, 9999))


def _date(rng: random.Random) -> str:
    return f"20{rng.randint(25, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _time(rng: random.Random) -> str:
    return f"{rng.randint(6, 22):02d}:{rng.choice([0, 15, 30, 45]):02d}"


def _email(rng: random.Random) -> str:
    return f"{made_up_word(rng, False)}@{made_up_word(rng, False)}.com"


def _phrase(rng: random.Random) -> str:
    return " ".join(made_up_word(rng, False) for _ in range(rng.randint(2, 3)))


# value kind -> (JSON type, generator)
_VALUES: dict[str, tuple[str, Callable[[random.Random], Any]]] = {
    "name": ("string", lambda rng: made_up_word(rng)),
    "word": ("string", lambda rng: made_up_word(rng, False)),
    "code": ("string", _code),
    "date": ("string", _date),
    "time": ("string", _time),
    "email": ("string", _email),
    "phrase": ("string", _phrase),
    "count": ("integer", lambda rng: rng.randint(1, 12)),
    "big": ("integer", lambda rng: rng.randint(13, 9000)),
    "amount": ("number", lambda rng: round(rng.uniform(1, 999), rng.choice([1, 2]))),
    "flag": ("boolean", lambda rng: rng.random() < 0.5),
}

# -- tool schemas: names from word banks split between training and evaluation ----------------------------------------
_VERBS = {
    "train": ["get", "find", "search", "create", "update", "delete", "list", "book", "cancel", "send", "check", "set",
              "add", "remove", "schedule", "track", "convert", "start", "stop", "order", "reserve", "rate", "share",
              "open", "close", "count", "rename", "copy", "move", "print"],
    "eval": ["fetch", "lookup", "register", "archive", "endorse", "estimate", "assign", "publish", "refund", "locate"],
}  # fmt: skip
_NOUNS = {
    "train": ["weather", "flight", "hotel", "stock price", "currency", "recipe", "movie", "timer", "email", "package",
              "restaurant table", "calendar event", "song", "invoice", "ticket", "meeting", "reminder", "playlist",
              "file", "photo", "note", "task", "contact", "order", "product", "review", "car", "bike", "train seat",
              "bus route", "taxi", "parking spot", "doctor visit", "pet", "plant", "game", "book", "podcast", "news",
              "account", "payment", "budget", "loan", "course", "room", "light", "thermostat", "alarm", "door lock",
              "pizza", "coffee", "grocery list", "shipment", "password", "backup", "report", "survey", "workout",
              "lesson", "concert", "museum pass", "gift card", "subscription", "warranty", "translation", "map",
              "video", "message", "printer", "battery", "garden bed", "recipe card", "tax form", "passport", "visa"],
    "eval": ["ferry", "kayak", "violin", "telescope", "glacier tour", "lighthouse climb", "bakery crate",
             "chess match", "vaccine slot", "satellite link", "orchard", "tram token", "pottery class", "harbor berth",
             "sled", "mosaic", "beehive", "canoe rental", "observatory", "vineyard tour"],
}  # fmt: skip
# argument name -> value kind; a nested object's name -> its fields
_ARGS = {
    "train": {"city": "name", "country": "name", "title": "phrase", "date": "date", "time": "time", "email": "email",
              "code": "code", "username": "word", "color": "word", "language": "name", "address": "phrase",
              "message": "phrase", "category": "word", "brand": "name", "model": "code", "quantity": "count",
              "nights": "count", "people": "count", "minutes": "count", "floor": "count", "rating": "count",
              "limit": "count", "year": "big", "distance": "big", "amount": "amount", "price": "amount",
              "weight": "amount", "urgent": "flag", "public": "flag", "notify": "flag", "recipient": "email",
              "topic": "word", "author": "name", "artist": "name", "origin": "name", "destination": "name",
              "start_date": "date", "end_date": "date", "account_id": "code", "order_number": "code",
              "max_price": "amount", "guest_name": "name", "room_type": "word"},
    "eval": {"harbor": "name", "vessel_name": "name", "guest_count": "count", "berth_code": "code",
             "departure_day": "date", "arrival_hour": "time", "captain_email": "email", "cargo_weight": "amount",
             "fare_total": "amount", "insured": "flag", "express": "flag", "season_year": "big",
             "crew_note": "phrase", "region": "name", "tier": "word"},
}  # fmt: skip
_OBJECTS = {
    "train": {"location": ["city", "country"], "window": ["start_date", "end_date"], "owner": ["username", "email"]},
    "eval": {"dock": ["harbor", "berth_code"], "voyage": ["departure_day", "arrival_hour"]},
}
_ENUMS = {
    "train": {"unit": ["celsius", "fahrenheit"], "priority": ["low", "medium", "high"],
              "size": ["small", "medium", "large"], "mode": ["walking", "driving", "cycling"],
              "format": ["pdf", "csv", "text"], "sort": ["newest", "oldest", "popular"]},
    "eval": {"cabin_class": ["deck", "berth", "suite"], "tide": ["rising", "falling", "slack"],
             "finish": ["matte", "glossy"]},
}  # fmt: skip
_LEADS = ["Please {v}", "Can you {v}", "I need you to {v}", "Could you {v}", "{V}", "Go ahead and {v}"]


@dataclass(frozen=True)
class Argument:
    """One parameter: its name, JSON schema, whether a call must give it, and how to make up a value for it."""

    name: str
    schema: dict[str, Any]
    required: bool
    kind: str  # a `_VALUES` key, "enum", or "object"
    fields: tuple[Argument, ...] = ()

    def value(self, rng: random.Random) -> Any:
        if self.kind == "enum":
            return rng.choice(self.schema["enum"])
        if self.kind == "object":
            return {f.name: f.value(rng) for f in self.fields}
        return _VALUES[self.kind][1](rng)

    def say(self, value: Any) -> str:
        """How a user states this argument's value: its name in words, then the value."""
        words = self.name.replace("_", " ")
        if self.kind == "object":
            inner = " and ".join(f.say(value[f.name]) for f in self.fields)
            return f"{words} with {inner}"
        if self.kind == "flag":
            return f"{words} {'yes' if value else 'no'}"
        return f"{words} {value}"


@dataclass(frozen=True)
class ToolSchema:
    """One function in OpenAI's tool format: `verb_noun(arguments)`, and what the user says to ask for it."""

    verb: str
    noun: str
    arguments: tuple[Argument, ...]

    @property
    def name(self) -> str:
        return f"{self.verb}_{self.noun.replace(' ', '_')}"

    @property
    def parameters(self) -> dict[str, Any]:
        return _object_schema(self.arguments)

    def tool(self) -> dict[str, Any]:
        """As `tools` take it: `{"type": "function", "function": {...}}`."""
        article = "an" if self.noun[0] in "aeiou" else "a"
        fn = {"name": self.name, "description": f"{self.verb.capitalize()} {article} {self.noun}.",
              "parameters": self.parameters}  # fmt: skip
        return {"type": "function", "function": fn}


def _object_schema(arguments: tuple[Argument, ...]) -> dict[str, Any]:
    return {"type": "object", "properties": {a.name: a.schema for a in arguments},
            "required": [a.name for a in arguments if a.required], "additionalProperties": False}  # fmt: skip


def _argument(rng: random.Random, split: Split, name: str, required: bool) -> Argument:
    if name in _ENUMS[split]:
        return Argument(name, {"type": "string", "enum": _ENUMS[split][name]}, required, "enum")
    if name in _OBJECTS[split]:
        fields = tuple(_argument(rng, split, f, True) for f in _OBJECTS[split][name])
        return Argument(name, _object_schema(fields), required, "object", fields)
    kind = _ARGS[split][name]
    return Argument(name, {"type": _VALUES[kind][0]}, required, kind)


def make_schema(rng: random.Random, split: Split, verb: str | None = None, noun: str | None = None) -> ToolSchema:
    """A made-up function of `split`'s banks: one to four arguments (an enum a quarter of the time, a nested object
    a sixth), the first required, later ones optional a third of the time."""
    names = list(_ARGS[split])
    count = rng.choice([1, 1, 2, 2, 2, 3, 3, 4])
    chosen = rng.sample(names, count)
    if rng.random() < 0.25:
        chosen[rng.randrange(count)] = rng.choice(list(_ENUMS[split]))
    if rng.random() < 1 / 6:
        chosen[rng.randrange(count)] = rng.choice(list(_OBJECTS[split]))
    chosen = list(dict.fromkeys(chosen))  # an enum or object drawn twice appears once
    arguments = tuple(_argument(rng, split, n, i == 0 or rng.random() > 1 / 3) for i, n in enumerate(chosen))
    return ToolSchema(verb or rng.choice(_VERBS[split]), noun or rng.choice(_NOUNS[split]), arguments)


def _distractors(rng: random.Random, split: Split, target: ToolSchema, k: int) -> list[ToolSchema]:
    """`k` other functions: some with the target's verb, some with its noun (reading one word is not enough)."""
    out: list[ToolSchema] = []
    while len(out) < k:
        r = rng.random()
        other = make_schema(rng, split, verb=target.verb if r < 0.35 else None,
                            noun=target.noun if 0.35 <= r < 0.7 else None)  # fmt: skip
        if other.name != target.name and other.name not in {o.name for o in out}:
            out.append(other)
    return out


def _request(rng: random.Random, schema: ToolSchema, args: dict[str, Any]) -> str:
    by_name = {a.name: a for a in schema.arguments}
    stated = [by_name[n].say(v) for n, v in args.items()]
    rng.shuffle(stated)
    said = ", ".join(stated[:-1]) + " and " + stated[-1] if len(stated) > 1 else stated[0]
    lead = rng.choice(_LEADS).format(v=schema.verb, V=schema.verb.capitalize())
    article = rng.choice(["a", "the", "my"])
    return f"{lead} {article} {schema.noun}{rng.choice([' with ', ': ', ', '])}{said}."


# -- examples ----------------------------------------------------------------------------------------------------------


@dataclass
class Example:
    """One prompt: the conversation so far (ChatML messages), the tools shown, and what a right reply is.

    skill: "chat", "text", "tools" or "recall". expected: for tools the call `{"name", "arguments"}`, for recall the
    answer's value, for chat and text None (the teacher's reply is the target). filler_turns: for recall, how many
    unrelated exchanges sit between the fact and the question. answer: the reply to learn where it is known (the
    call's text, the recall sentence). Earlier assistant turns in `messages` with `"target": True` are learnt too
    (a tool call before its result, an earlier recall answer); `target_turns` lists them.
    """

    skill: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    expected: Any = None
    filler_turns: int = 0
    schema: dict[str, Any] | None = field(default=None, repr=False)  # the called function's parameters (tools)
    answer: str | None = None

    @property
    def target_turns(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m.get("target")]


TOOL_SYSTEM = "You are a helpful assistant with tools. Call a tool when one fits."


def call_text(call: dict[str, Any], start: str = "<tool_call>", end: str = "</tool_call>") -> str:
    """A call as the checkpoint writes it: `{"name": ..., "arguments": {...}}` between its tags (json.dumps layout,
    the one the structured-outputs grammar enforces)."""
    return start + json.dumps(call, ensure_ascii=False) + end


def tool_example(rng: random.Random, split: Split) -> Example:
    """A request for one of one to five shown functions; the target is the call."""
    schema = make_schema(rng, split)
    args = {a.name: a.value(rng) for a in schema.arguments if a.required or rng.random() < 0.5}
    shown = [schema, *_distractors(rng, split, schema, rng.choice([0, 1, 2, 2, 3, 4]))]
    rng.shuffle(shown)
    call = {"name": schema.name, "arguments": args}
    return Example(
        skill="tools",
        messages=[{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": _request(rng, schema, args)}],
        tools=[s.tool() for s in shown],
        expected=call,
        schema=schema.parameters,
        answer=call_text(call),
    )


_RESULT_FIELDS = {"train": ["confirmation", "reference", "status_code", "ticket_id", "booking_code"],
                  "eval": ["receipt_token", "berth_pass"]}  # fmt: skip


def tool_turn(rng: random.Random, split: Split) -> Example:
    """A tool example carried on: the call (a target), the tool's JSON result, and the final answer quoting it."""
    ex = tool_example(rng, split)
    field_name = rng.choice(_RESULT_FIELDS[split])
    value = _code(rng)
    call = {"type": "function", "function": ex.expected}
    ex.messages += [
        {"role": "assistant", "content": "", "tool_calls": [call], "target": True},
        {"role": "tool", "content": json.dumps({"status": "ok", field_name: value})},
    ]
    what, label = ex.expected["name"].replace("_", " "), field_name.replace("_", " ")
    ex.answer = f"Done: the {what} went through, {label} {value}."
    ex.expected = value
    return ex


# -- recall ------------------------------------------------------------------------------------------------------------
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
EVAL_VALUES = {v.lower() for fact in _FACTS for v in fact[4]}  # never a training answer, nor in a word list
# Training facts beyond the five above: "My {owner}'s {thing} is {value}." in many combinations.
_OWNERS = ["brother", "friend", "boss", "neighbour", "dentist", "cousin", "landlord", "teacher", "uncle", "coach"]
_THINGS = [("name", "name"), ("favourite colour", "word"), ("lucky number", "number"), ("car plate", "gate"),
           ("home town", "place"), ("dog's name", "name"), ("locker number", "number"),
           ("password", "word")]  # fmt: skip
_TRAIN_VALUES: dict[str, Callable[[random.Random], str]] = {
    "name": lambda rng: made_up_word(rng),
    "number": lambda rng: str(rng.randint(1, 999)),
    "word": lambda rng: made_up_word(rng, False),
    "gate": lambda rng: rng.choice("ABCDEFGHKLMNPRST") + str(rng.randint(1, 99)),
    "place": lambda rng: made_up_word(rng),
}


def fact_value(rng: random.Random, kind: str, split: Split, eval_values: list[str]) -> str:
    """An answer: one of the fact's evaluation values, or for training a made-up one that is none of them."""
    if split == "eval":
        return rng.choice(eval_values)
    while (value := _TRAIN_VALUES[kind](rng)).lower() in EVAL_VALUES:
        pass
    return value


def _fact(rng: random.Random, split: Split) -> tuple[str, str, str, str]:
    """(statement, question, answer sentence, value): one of `_FACTS`, or in training often a made-up owner's thing."""
    if split == "train" and rng.random() < 0.6:
        owner, (thing, kind) = rng.choice(_OWNERS), rng.choice(_THINGS)
        v = fact_value(rng, kind, split, [])
        return (f"My {owner}'s {thing} is {v}.", f"What is my {owner}'s {thing}?", f"Your {owner}'s {thing} is {v}.",
                v)  # fmt: skip
    statement, question, sentence, kind, eval_values = rng.choice(_FACTS)
    v = fact_value(rng, kind, split, eval_values)
    return statement.format(v=v), question, sentence.format(v=v), v


FILLER = [
    ("What is a good name for a cat?", "Maybe Pepper or Miso."),
    ("Tell me a fun fact about octopuses.", "An octopus has three hearts."),
    ("How do I boil an egg?", "Put it in boiling water for about nine minutes."),
    ("Suggest a weekend hobby.", "Try sketching outdoors."),
    ("What rhymes with moon?", "Spoon, tune and dune."),
    ("Give me a word for happy.", "Cheerful."),
    ("Why is the sky blue?", "Air scatters blue light more than red light."),
    ("Name a prime number above twenty.", "Twenty-three."),
    ("What should I cook tonight?", "A vegetable stir-fry is quick and easy."),
    ("How many legs does a spider have?", "Eight."),
    ("Recommend a classic novel.", "Pride and Prejudice by Jane Austen."),
    ("What is the opposite of ancient?", "Modern."),
    ("How can I sleep better?", "Keep a regular bedtime and avoid screens late at night."),
    ("What is the largest planet?", "Jupiter."),
    ("Give me a tip for studying.", "Study in short sessions with breaks."),
    ("What colour do you get from blue and yellow?", "Green."),
]
RECALL_SYSTEM = "You are a helpful assistant. Remember what the user tells you."
ACK = "Got it, I will remember that."


def recall_example(rng: random.Random, split: Split, filler_turns: int, questions: int = 1) -> Example:
    """Up to `questions` facts stated first, `filler_turns` unrelated exchanges, then a question on each fact in turn
    (answers to earlier questions are targets too), with filler between the questions; the last answer is `answer`."""
    facts = [_fact(rng, split) for _ in range(questions)]
    facts = list({f[1]: f for f in facts}.values())  # one question per fact
    messages: list[dict[str, Any]] = [{"role": "system", "content": RECALL_SYSTEM}]
    for statement, *_ in facts:
        messages += [{"role": "user", "content": statement}, {"role": "assistant", "content": ACK}]
    order = rng.sample(facts, len(facts))
    for k, (_, question, sentence, _) in enumerate(order):
        for _ in range(filler_turns if k == 0 else rng.randint(0, filler_turns)):
            ask, reply = rng.choice(FILLER)
            messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": question})
        if k < len(order) - 1:
            messages.append({"role": "assistant", "content": sentence, "target": True})
    _, _, sentence, value = order[-1]
    return Example(skill="recall", messages=messages, expected=value, filler_turns=filler_turns, answer=sentence)


# -- chat and text -----------------------------------------------------------------------------------------------------
_CHAT = ["Write a haiku about {t}.", "Explain {t} to a child in two sentences.", "Give me three tips about {t}.",
         "What is one surprising fact about {t}?", "Summarise what {t} is in one sentence.",
         "Write a short poem about {t}.", "Why do people like {t}?", "Tell me a very short story about {t}.",
         "List two facts about {t}.", "Describe {t} in three words.", "What is {t}?", "How do {t} work?",
         "Write one sentence about {t}.", "What is the history of {t}?", "Give me a fun fact about {t}."]  # fmt: skip
_TOPICS = ["rain", "bridges", "honey bees", "volcanoes", "chess", "the moon", "bread", "trains", "coral reefs",
           "ink", "clouds", "libraries", "bicycles", "tea", "maps", "owls", "glaciers", "music", "gardens",
           "lighthouses", "deserts", "kites", "rivers", "penguins", "cheese", "clocks", "forests", "paper",
           "the ocean", "snow", "octopuses", "the sun", "computers", "birds", "mountains", "elephants", "coffee",
           "football", "rainbows", "windmills", "castles", "dinosaurs", "robots", "islands", "butterflies", "stars",
           "pianos", "sharks", "the wind", "apples", "cities", "whales", "frogs", "the desert", "spiders",
           "tomatoes", "magnets"]  # fmt: skip
_QUESTIONS = ["What is the capital of {c}?", "Where is {c}?", "What language do people speak in {c}?",
              "Name a famous food from {c}."]  # fmt: skip
_COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "Italy", "India", "Kenya", "Mexico", "Norway",
              "Spain", "Germany", "China", "Peru", "Greece", "Australia", "Turkey", "Chile", "Poland",
              "Vietnam"]  # fmt: skip
_TEXT_OPENERS = ["Once upon a time", "Long ago, in a small village,", "The old man looked at", "Every morning,",
                 "In the beginning", "It was a cold night when", "The history of", "My favourite place is",
                 "Scientists have found that", "The little girl wanted", "On the first day of summer,",
                 "Nobody expected", "At the edge of the forest,", "The best way to learn"]  # fmt: skip
_TEXT_SUBJECTS = {
    "train": ["a fox", "the baker", "a young sailor", "the king", "a robot", "two friends", "the teacher",
              "a lonely dragon", "the farmer", "a curious cat", "the river", "a painter", "the doctor", "a small boat",
              "the city", "an old dog", "the queen", "a brave knight", "the students", "a musician"],
    "eval": ["a shy giant", "the astronomer", "a tiny mouse", "the fisherman", "a clockmaker"],
}  # fmt: skip


def chat_example(rng: random.Random, split: Split) -> Example:
    """A request or question; a third of the time with tools that do not fit it (the reply is words, not a call)."""
    if rng.random() < 0.25:
        request = rng.choice(_QUESTIONS).format(c=rng.choice(_COUNTRIES))
    else:
        request = rng.choice(_CHAT).format(t=rng.choice(_TOPICS))
    ex = Example(skill="chat", messages=[{"role": "user", "content": request}])
    if rng.random() < 1 / 3:
        ex.tools = [make_schema(rng, split).tool() for _ in range(rng.randint(1, 3))]
        ex.messages.insert(0, {"role": "system", "content": TOOL_SYSTEM})
    return ex


def text_example(rng: random.Random, split: Split) -> Example:
    """A plain-text opener (no chat template): `messages` holds it as one user message's content for the record;
    training encodes the text itself."""
    opener = f"{rng.choice(_TEXT_OPENERS)} {rng.choice(_TEXT_SUBJECTS[split])}"
    return Example(skill="text", messages=[{"role": "user", "content": opener}])


def filler_turns(rng: random.Random, most: int) -> int:
    """How many filler exchanges a recall example gets: uniform up to 8 half the time, else log-uniform up to `most`
    (short conversations teach the task, long ones teach holding the fact across many tokens)."""
    if most <= 8 or rng.random() < 0.5:
        return rng.randint(0, min(8, most))
    return min(most, int(round(8 * (most / 8) ** rng.random())))


def target_reply(example: Example) -> str | None:
    """The final reply to learn where the right one is known (a call, a tool result's answer, a recall answer);
    None for chat and text, whose replies the teacher writes."""
    return example.answer


def example(rng: random.Random, split: Split, skill: str, max_filler_turns: int = 96) -> Example:
    """One example of `skill` ("tools" is a lone call three times in four, else a call with its result)."""
    if skill == "tools":
        return tool_example(rng, split) if split == "eval" or rng.random() < 0.75 else tool_turn(rng, split)
    if skill == "recall":
        return recall_example(rng, split, filler_turns(rng, max_filler_turns),
                              1 if split == "eval" else rng.choice([1, 1, 2, 3]))  # fmt: skip
    if skill == "text":
        return text_example(rng, split)
    if skill == "chat":
        return chat_example(rng, split)
    raise ValueError(f"unknown skill {skill!r}; expected one of {SKILLS}")


def examples(split: Split, seed: int, n: int, skills: tuple[str, ...] = SKILLS,
             max_filler_turns: int = 96) -> list[Example]:  # fmt: skip
    """`n` examples of `split`, cycling through `skills`; the same for the same arguments in any process."""
    _check_split(split)
    rng = random.Random(f"kvfree-demo/{split}/{seed}")
    return [example(rng, split, skills[i % len(skills)], max_filler_turns) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print kvfree-demo training or evaluation prompts as JSON lines.")
    ap.add_argument("--split", choices=["train", "eval"], default="train")
    ap.add_argument("--skill", choices=SKILLS, action="append", help="default: every skill in turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=6)
    a = ap.parse_args(argv)
    for ex in examples(a.split, a.seed, a.n, tuple(a.skill or SKILLS)):
        print(json.dumps(asdict(ex), ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
