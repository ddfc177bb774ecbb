"""The toy target: a small Llama causal LM that behaves like a reasoning model.

Kept whole (about 670 lines): most of the length is the synthetic conversation generators,
which are data more than logic.

``build_toy_target`` writes an HF model directory (config, bf16 safetensors weights, byte-level
BPE tokenizer, chat template) that vLLM serves with ``--reasoning-parser deepseek_r1``.

A random model never closes its thinking block, so every reply would carry reasoning and a null
answer. The toy is therefore trained briefly on synthetic conversations rendered with its own
chat template: reasoning, ``</think>``, a short answer, ``<|end|>``. Sampled replies then
open and close the thinking block and stop well before the usual token limits, like a real
reasoning target would.

Everything is seeded and runs on a fixed thread count: the same ``toy_cfg`` gives
byte-identical files on the same software stack.

Heavy packages (torch, transformers, tokenizers, jinja2) are imported inside functions.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from draftline.core.atomic import atomic_dir
from draftline.core.config import resolve_section

SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
END, PAD = "<|end|>", "<|pad|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Order fixes the token ids 0..6.
SPECIAL_TOKENS = [PAD, END, SYSTEM, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE]
# vLLM's reasoning parser searches the detokenized text for <think>/</think>; if they were
# "special" they would be skipped when detokenizing and every reply would look unclosed.
NOT_SKIPPED_ON_DECODE = {THINK_OPEN, THINK_CLOSE}

GENERATION_PROMPT = f"{ASSISTANT}\n{THINK_OPEN}\n"

# Each turn is `<|role|>\n{content}<|end|>\n`; an assistant turn carries its reasoning in a
# thinking block. Reasoning and answer are trimmed so that the message vLLM's parser returns
# (reasoning "...\n", content "\n\n...") renders back to exactly the tokens the model produced.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{%- set reasoning = message.get('reasoning_content') or message.get('reasoning') or '' -%}\n"
    "{{- '<|assistant|>\\n<think>\\n' + reasoning | trim + '\\n</think>\\n\\n'"
    " + (message['content'] or '') | trim + '<|end|>\\n' -}}\n"
    "{%- elif message['role'] in ['system', 'user'] -%}\n"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}\n"
    "{%- else -%}\n"
    "{{- raise_exception('unsupported role: ' + message['role']) -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|assistant|>\\n<think>\\n' -}}\n"
    "{%- endif -%}"
)

MAX_POSITION_EMBEDDINGS = 2048
TRAIN_THREADS = 1  # fixed (reductions depend on it); more threads crawl on a busy host
BATCH_SIZE = 16
LEARNING_RATE = 3e-3
WARMUP_STEPS = 20
CONVERSATIONS_PER_BUILD = 2000

# ----------------------------------------------------------------------------- chat template


@functools.cache
def _compiled_chat_template():
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Render ``messages`` with CHAT_TEMPLATE the way transformers does (same Jinja settings)."""
    return _compiled_chat_template().render(
        messages=messages, add_generation_prompt=add_generation_prompt
    )


# ----------------------------------------------------------------------------- corpus

_SENTENCES_FILE = "toy/sentences.txt"

_CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
    "Portugal": "Lisbon", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Poland": "Warsaw", "Austria": "Vienna", "Greece": "Athens", "Ireland": "Dublin",
    "Egypt": "Cairo", "Kenya": "Nairobi", "Japan": "Tokyo", "China": "Beijing",
    "India": "New Delhi", "Canada": "Ottawa", "Mexico": "Mexico City", "Peru": "Lima",
    "Chile": "Santiago", "Argentina": "Buenos Aires", "Australia": "Canberra",
    "Turkey": "Ankara", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Brazil": "Brasilia",
    "Morocco": "Rabat", "Denmark": "Copenhagen", "Hungary": "Budapest",
}
_ANIMALS = {  # name: (legs, home, sound or habit)
    "cat": (4, "houses and gardens", "meows"), "dog": (4, "houses and farms", "barks"),
    "cow": (4, "farms and fields", "moos"), "duck": (2, "ponds and rivers", "quacks"),
    "horse": (4, "farms and open fields", "neighs"), "owl": (2, "forests", "hoots"),
    "frog": (4, "ponds and wetlands", "croaks"), "sheep": (4, "hills and farms", "bleats"),
    "spider": (8, "corners and gardens", "spins webs"), "bee": (6, "hives", "buzzes"),
    "snake": (0, "grass and deserts", "hisses"), "lion": (4, "the savanna", "roars"),
    "penguin": (2, "icy coasts", "swims"), "ant": (6, "nests in the soil", "carries food"),
    "crab": (10, "beaches and the sea floor", "walks sideways"),
}
_OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "early": "late", "happy": "sad",
    "light": "dark", "open": "closed", "full": "empty", "high": "low", "old": "new",
    "strong": "weak", "wet": "dry", "loud": "quiet", "easy": "hard", "near": "far",
    "rich": "poor", "clean": "dirty", "long": "short", "thick": "thin", "up": "down",
}
_THINGS_BY_COLOR = {
    "red": ["apple", "tomato", "strawberry", "cherry"], "yellow": ["banana", "lemon", "corn"],
    "green": ["lime", "pea", "cucumber", "kiwi"], "orange": ["carrot", "orange", "pumpkin"],
    "purple": ["grape", "plum", "eggplant"], "white": ["milk", "rice", "snow"],
}
_WORDS = [
    "garden", "planet", "window", "river", "candle", "pencil", "market", "silver", "winter",
    "bottle", "forest", "rocket", "kitten", "orange", "ladder", "mirror", "basket", "castle",
    "anchor", "button", "dragon", "island", "jacket", "lemon", "magnet", "needle", "pepper",
    "rabbit", "saddle", "tunnel", "violin", "wallet", "yellow", "zebra", "bridge", "cloud",
    "storm", "train", "music", "paper", "stone", "water", "light", "table", "chair", "green",
    "house", "sugar", "tiger", "honey", "piano", "smile", "dream", "ocean", "north", "bread",
]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_PLANETS = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
_TOPICS = {  # topic: a few plain facts
    "the sun": ["The sun is a star.", "It gives the Earth light and heat."],
    "rain": ["Rain is water that falls from clouds.", "Plants need it to grow."],
    "trees": ["Trees are tall plants with wooden trunks.", "They make oxygen and give shade."],
    "the ocean": ["The ocean is a huge body of salt water.", "It covers most of the Earth."],
    "computers": ["A computer follows instructions called programs.", "It stores data."],
    "bicycles": ["A bicycle has two wheels and pedals.", "Riding one is good exercise."],
    "music": ["Music is sound arranged in time.", "People play it with voices and instruments."],
    "volcanoes": ["A volcano is an opening in the ground.", "Hot melted rock comes out of it."],
    "the moon": ["The moon goes around the Earth.", "It reflects light from the sun."],
    "bread": ["Bread is made from flour, water and yeast.", "It is baked in an oven."],
    "honey bees": ["Honey bees live in hives.", "They make honey from flower nectar."],
    "maps": ["A map is a drawing of a place.", "It helps people find their way."],
    "sleep": ["Sleep lets the body rest.", "Most adults need seven to nine hours."],
    "snow": ["Snow is frozen water that falls as flakes.", "It forms when the air is cold."],
    "email": ["Email is a way to send messages over the internet.", "It arrives in seconds."],
    "python": ["Python is a programming language.", "It is known for readable code."],
}
_SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a friendly tutor who explains things simply.",
    "Think step by step, then give a short answer.",
]

# A conversation family returns (user text, reasoning, answer).
Example = tuple[str, str, str]


def _arithmetic(rng: random.Random, _: list[str]) -> Example:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        b = rng.randint(2, 12)
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    name = {"+": "add", "-": "subtract", "*": "multiply"}[op]
    ask = rng.choice(["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}"])
    steps = {
        "+": f"{a} + {b}: {a} plus {b // 10 * 10} is {a + b // 10 * 10}, then plus {b % 10}"
        f" is {result}.",
        "-": f"{a} - {b}: {a} minus {b // 10 * 10} is {a - b // 10 * 10}, then minus {b % 10}"
        f" is {result}.",
        "*": f"{a} * {b} means {b} groups of {a}. {a} times {b} is {result}.",
    }[op]
    reasoning = f"I need to {name} the numbers. {steps}"
    answer = rng.choice([f"{a} {op} {b} = {result}.", f"The answer is {result}.", f"{result}"])
    return ask.format(a=a, op=op, b=b), reasoning, answer


def _reverse_word(rng: random.Random, _: list[str]) -> Example:
    word = rng.choice(_WORDS)
    letters = ", ".join(word)
    reasoning = f"The letters of {word} are {letters}. Read backwards: {', '.join(word[::-1])}."
    ask = rng.choice(["Reverse the word '{w}'.", "Spell {w} backwards.", "What is {w} reversed?"])
    return ask.format(w=word), reasoning, f"{word[::-1]}"


def _count_letters(rng: random.Random, _: list[str]) -> Example:
    word = rng.choice(_WORDS)
    if rng.random() < 0.5:
        letter = rng.choice(word)
        n = word.count(letter)
        reasoning = f"I look at each letter of {word}: {', '.join(word)}. '{letter}' appears {n}."
        return f"How many times does '{letter}' appear in '{word}'?", reasoning, f"{n}"
    reasoning = f"The letters of {word} are {', '.join(word)}. That is {len(word)} letters."
    answer = f"{word} has {len(word)} letters."
    return f"How many letters are in the word {word}?", reasoning, answer


def _change_case(rng: random.Random, sentences: list[str]) -> Example:
    text = rng.choice(sentences)
    if rng.random() < 0.5:
        reasoning = "I write every letter as a capital letter and keep the punctuation."
        return f"Write this in capital letters: {text}", reasoning, text.upper()
    reasoning = "I write every letter in lower case and keep the punctuation."
    return f"Convert to lower case: {text}", reasoning, text.lower()


def _sort_items(rng: random.Random, _: list[str]) -> Example:
    if rng.random() < 0.5:
        nums = rng.sample(range(1, 100), rng.randint(3, 6))
        ordered = sorted(nums)
        reasoning = f"The smallest is {ordered[0]} and the largest is {ordered[-1]}. In order:"
        reasoning += " " + ", ".join(map(str, ordered)) + "."
        return f"Sort these numbers: {', '.join(map(str, nums))}", reasoning, str(ordered)
    words = rng.sample(_WORDS, rng.randint(3, 5))
    ordered = sorted(words)
    reasoning = "I compare the first letters: " + ", ".join(w[0] for w in words) + "."
    reasoning += f" Alphabetical order starts with {ordered[0]}."
    return f"Put these words in alphabetical order: {' '.join(words)}", reasoning, " ".join(ordered)


def _capital(rng: random.Random, _: list[str]) -> Example:
    country = rng.choice(sorted(_CAPITALS))
    city = _CAPITALS[country]
    ask = rng.choice(["What is the capital of {c}?", "Name the capital city of {c}.",
                      "Which city is the capital of {c}?"])
    reasoning = f"The question is about {country}. The capital of {country} is {city}."
    return ask.format(c=country), reasoning, f"The capital of {country} is {city}."


def _animal(rng: random.Random, _: list[str]) -> Example:
    name = rng.choice(sorted(_ANIMALS))
    legs, home, habit = _ANIMALS[name]
    kind = rng.randint(0, 2)
    if kind == 0:
        reasoning = f"A {name} has {legs} legs. I should give the number."
        return f"How many legs does a {name} have?", reasoning, f"A {name} has {legs} legs."
    if kind == 1:
        reasoning = f"A {name} usually lives in {home}."
        return f"Where does a {name} live?", reasoning, f"A {name} lives in {home}."
    reasoning = f"The user wants one fact about the {name}. A {name} {habit}."
    return f"Tell me one fact about the {name}.", reasoning, f"The {name} {habit}."


def _opposite(rng: random.Random, _: list[str]) -> Example:
    word = rng.choice(sorted(_OPPOSITES))
    other = _OPPOSITES[word]
    if rng.random() < 0.5:
        word, other = other, word
    reasoning = f"The opposite of {word} is the word with the reverse meaning: {other}."
    ask = rng.choice(["What is the opposite of '{w}'?", "Give an antonym for {w}."])
    return ask.format(w=word), reasoning, f"The opposite of {word} is {other}."


def _color(rng: random.Random, _: list[str]) -> Example:
    color = rng.choice(sorted(_THINGS_BY_COLOR))
    things = _THINGS_BY_COLOR[color]
    n = min(len(things), rng.randint(2, 3))
    picked = rng.sample(things, n)
    reasoning = f"Things that are usually {color}: {', '.join(things)}. I pick {n} of them."
    return f"Name {n} things that are {color}.", reasoning, ", ".join(picked) + "."


def _day_math(rng: random.Random, _: list[str]) -> Example:
    start = rng.randrange(7)
    k = rng.randint(1, 10)
    end = (start + k) % 7
    reasoning = (f"Counting {k} days forward from {_DAYS[start]}: {k} mod 7 is {k % 7},"
                 f" so it lands on {_DAYS[end]}.")
    return (f"If today is {_DAYS[start]}, what day is it in {k} days?", reasoning,
            f"It will be {_DAYS[end]}.")


def _planet(rng: random.Random, _: list[str]) -> Example:
    i = rng.randrange(len(_PLANETS))
    ordinal = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"][i]
    if rng.random() < 0.5:
        reasoning = f"From the sun the planets are {', '.join(_PLANETS[: i + 1])}."
        return (f"Which planet is {ordinal} from the sun?", reasoning,
                f"{_PLANETS[i]} is the {ordinal} planet from the sun.")
    reasoning = f"Counting from the sun, {_PLANETS[i]} comes at position {i + 1}."
    return (f"What position is {_PLANETS[i]} from the sun?", reasoning,
            f"{_PLANETS[i]} is the {ordinal} planet.")


def _units(rng: random.Random, _: list[str]) -> Example:
    n = rng.randint(2, 60)
    unit, small, factor = rng.choice([("minutes", "seconds", 60), ("hours", "minutes", 60),
                                      ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
                                      ("days", "hours", 24), ("weeks", "days", 7)])
    reasoning = f"One {unit[:-1]} is {factor} {small}. So {n} {unit} is {n} * {factor}."
    return f"How many {small} are in {n} {unit}?", reasoning, f"{n * factor} {small}."


def _parity_compare(rng: random.Random, _: list[str]) -> Example:
    a, b = rng.randint(1, 999), rng.randint(1, 999)
    if rng.random() < 0.5:
        parity = "even" if a % 2 == 0 else "odd"
        reasoning = f"The last digit of {a} is {a % 10}. A number ending in it is {parity}."
        return f"Is {a} even or odd?", reasoning, f"{a} is {parity}."
    bigger = max(a, b)
    reasoning = f"Compare {a} and {b}. {bigger} is larger."
    return f"Which is bigger, {a} or {b}?", reasoning, f"{bigger}"


def _sentence_task(rng: random.Random, sentences: list[str]) -> Example:
    text = rng.choice(sentences)
    words = text.rstrip(".?!;").split()
    kind = rng.randint(0, 2)
    if kind == 0:
        reasoning = f"I count the words one by one. There are {len(words)} words."
        return f"How many words are in this sentence? {text}", reasoning, f"{len(words)} words."
    if kind == 1:
        reasoning = f"The first word is '{words[0]}' and the last word is '{words[-1]}'."
        return f"What are the first and last words of: {text}", reasoning, \
            f"First: {words[0]}. Last: {words[-1]}."
    reasoning = "The user asks me to repeat the sentence. I copy it exactly."
    return f"Repeat after me: {text}", reasoning, text


def _topic(rng: random.Random, _: list[str]) -> Example:
    topic = rng.choice(sorted(_TOPICS))
    facts = _TOPICS[topic]
    ask = rng.choice(["Tell me about {t}.", "Explain {t} in simple words.",
                      "What do you know about {t}?", "Write two sentences about {t}."])
    reasoning = f"The user asks about {topic}. I will give a short, simple explanation."
    return ask.format(t=topic), reasoning, " ".join(facts)


def _counting(rng: random.Random, _: list[str]) -> Example:
    """Longer replies (up to ~120 tokens) so output lengths have a realistic tail."""
    step = rng.choice([1, 1, 2, 3, 5, 10])
    start = rng.randint(0, 20) * step
    count = rng.randint(5, 40)
    numbers = [start + step * i for i in range(count)]
    if step == 1:
        ask = f"Count from {numbers[0]} to {numbers[-1]}."
    else:
        ask = f"List {count} numbers starting at {start}, going up by {step}."
    reasoning = (f"I start at {start} and add {step} each time until I have {count} numbers."
                 f" The last one is {numbers[-1]}.")
    return ask, reasoning, ", ".join(map(str, numbers))


def _open_ended(rng: random.Random, sentences: list[str]) -> Example:
    """Free-form requests; they teach the shape of a reply to prompts unlike the others."""
    text = rng.choice(sentences)
    kind = rng.randint(0, 3)
    if kind == 0:
        greeting = rng.choice(["Hello!", "Hi there.", "Good morning!", "Hey, how are you?"])
        reasoning = "The user greets me. I greet them back and offer help."
        return greeting, reasoning, "Hello! How can I help you today?"
    if kind == 1:
        reasoning = "I should write one simple sentence. I will use a sentence I know."
        subject = rng.choice(sorted(_TOPICS))
        return f"Write a short sentence about {subject}.", reasoning, text
    if kind == 2:
        reasoning = "The user asks for an opinion. I give a short, balanced reply."
        return f"What do you think about this? {text}", reasoning, \
            "It sounds reasonable. It depends on the situation, but I agree in general."
    reasoning = "The request is broad. I keep the answer short and clear."
    return f"Please help me with this: {text}", reasoning, \
        f"Sure. Here is a short note: {text}"


_FAMILIES: list[Callable[[random.Random, list[str]], Example]] = [
    _arithmetic, _reverse_word, _count_letters, _change_case, _sort_items, _capital, _animal,
    _opposite, _color, _day_math, _planet, _units, _parity_compare, _sentence_task, _topic,
    _counting, _open_ended,
]


def load_sentences() -> list[str]:
    """The varied sentences shipped with draftline (for prompts and for the tokenizer)."""
    text = (resources.files("draftline") / "data" / _SENTENCES_FILE).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def _turn(rng: random.Random, sentences: list[str]) -> list[dict]:
    user, reasoning, answer = rng.choice(_FAMILIES)(rng, sentences)
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer, "reasoning_content": reasoning},
    ]


def synthetic_conversations(n: int, seed: int) -> list[list[dict]]:
    """``n`` short conversations (OpenAI message lists) ending with an assistant turn.

    About 20% start with a system prompt and 15% have an earlier exchange, so the model sees
    every role and multi-turn context.
    """
    rng = random.Random(seed)
    sentences = load_sentences()
    conversations = []
    for _ in range(n):
        messages: list[dict] = []
        if rng.random() < 0.2:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        if rng.random() < 0.15:
            messages += _turn(rng, sentences)
        messages += _turn(rng, sentences)
        conversations.append(messages)
    return conversations


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (every string encodes) with SPECIAL_TOKENS as single tokens 0..6."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # The trainer registers every special token as skipped-on-decode; the thinking markers
    # must stay visible in the text (see NOT_SKIPPED_ON_DECODE).
    spec = json.loads(tokenizer.to_str())
    for added in spec["added_tokens"]:
        added["normalized"] = False
        added["special"] = added["content"] not in NOT_SKIPPED_ON_DECODE
    return Tokenizer.from_str(json.dumps(spec))


def _tokenizer_texts(conversations: list[list[dict]]) -> list[str]:
    """Plain message texts plus the shipped sentences (no markers: those are added tokens)."""
    texts = load_sentences()
    for messages in conversations:
        for message in messages:
            texts.append(message["content"])
            if message.get("reasoning_content"):
                texts.append(message["reasoning_content"] + "\n")
    return texts


def _tokenizer_config(tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": tok not in NOT_SKIPPED_ON_DECODE,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "bos_token": None,
        "eos_token": END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": [SYSTEM, USER, ASSISTANT],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


# ----------------------------------------------------------------------------- model


def model_config(toy_cfg: dict, tokenizer) -> dict:
    """config.json of the toy Llama (written explicitly so the bytes do not depend on defaults)."""
    hidden, heads = toy_cfg["hidden_size"], toy_cfg["num_heads"]
    if hidden % heads:
        raise ValueError(f"target.toy.num_heads ({heads}) must divide hidden_size ({hidden})")
    if tokenizer.get_vocab_size() > toy_cfg["vocab_size"]:
        raise ValueError(f"target.toy.vocab_size ({toy_cfg['vocab_size']}) is smaller than "
                         f"the tokenizer ({tokenizer.get_vocab_size()})")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": toy_cfg["intermediate_size"],
        "num_hidden_layers": toy_cfg["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-6,
        # Both spellings: transformers >= 5 reads rope_parameters, older readers rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "vocab_size": toy_cfg["vocab_size"],
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": tokenizer.token_to_id(END),
        "pad_token_id": tokenizer.token_to_id(PAD),
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def encode_for_training(conversations: list[list[dict]], tokenizer) -> list[tuple[list[int], int]]:
    """(token ids up to the final ``<|end|>``, index where the supervised reply starts).

    Only the last assistant turn is supervised: the model must learn to continue from the
    generation prompt, close the thinking block, answer and emit ``<|end|>``.
    """
    end_id = tokenizer.token_to_id(END)
    samples = []
    for i, messages in enumerate(conversations):
        prompt = render_chat(messages[:-1], add_generation_prompt=True)
        full = render_chat(messages)
        prompt_ids = tokenizer.encode(prompt).ids
        ids = tokenizer.encode(full).ids
        if ids[: len(prompt_ids)] != prompt_ids:
            raise ValueError(f"conversation {i}: prompt tokens are not a prefix of the full text")
        ids = ids[: len(ids) - ids[::-1].index(end_id)]  # drop the newline after <|end|>
        samples.append((ids, len(prompt_ids)))
    return samples


def _length_grouped_batches(lengths: list[int], seed: int) -> Iterator[list[int]]:
    """Endless random batches of sample indices with similar lengths (little padding)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    group = BATCH_SIZE * 16
    while True:  # one pass over the corpus per loop
        order = torch.randperm(len(lengths), generator=generator).tolist()
        batches = []
        for start in range(0, len(order), group):
            chunk = sorted(order[start : start + group], key=lambda i: (lengths[i], i))
            batches += [chunk[i : i + BATCH_SIZE] for i in range(0, len(chunk), BATCH_SIZE)]
        for b in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[b]


def _batches(samples, steps: int, seed: int, pad_id: int) -> Iterator[tuple]:
    """``steps`` batches: input_ids, attention_mask, labels, each ``[B, T]``."""
    import torch

    picks_per_step = _length_grouped_batches([len(ids) for ids, _ in samples], seed)
    for _, picks in zip(range(steps), picks_per_step, strict=False):  # endless picks
        width = max(len(samples[i][0]) for i in picks)
        input_ids = torch.full((len(picks), width), pad_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(picks), width), dtype=torch.long)  # [B, T]
        labels = torch.full((len(picks), width), -100, dtype=torch.long)  # [B, T]
        for row, i in enumerate(picks):
            ids, reply_start = samples[i]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
            labels[row, reply_start : len(ids)] = torch.tensor(ids[reply_start:])
        yield input_ids, attention_mask, labels


def _learning_rate(step: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < WARMUP_STEPS:
        return LEARNING_RATE * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return LEARNING_RATE * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_model(config: dict, samples, steps: int, seed: int) -> tuple[dict, float | None]:
    """Train a fresh Llama in fp32 for ``steps`` AdamW steps; return bf16 weights, last loss."""
    import torch
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "torch_dtype"})
    model = LlamaForCausalLM(hf_config).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95),
                                  weight_decay=0.01)
    loss_value = None
    batches = _batches(samples, steps, seed, config["pad_token_id"])
    progress = tqdm(batches, total=steps, desc="train toy target", unit="step")
    for step, (input_ids, attention_mask, labels) in enumerate(progress):
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, steps)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = loss.item()
        progress.set_postfix(loss=f"{loss_value:.3f}")
    weights = {name: t.detach().to(torch.bfloat16).contiguous()
               for name, t in model.state_dict().items()}
    return weights, loss_value


class _DeterministicTorch:
    """Fixed thread count and deterministic kernels for the build; restores both afterwards."""

    def __enter__(self):
        import torch

        self._threads = torch.get_num_threads()
        self._deterministic = torch.are_deterministic_algorithms_enabled()
        torch.set_num_threads(TRAIN_THREADS)
        torch.use_deterministic_algorithms(True)
        return self

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self._threads)
        torch.use_deterministic_algorithms(self._deterministic)


# ----------------------------------------------------------------------------- files


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_model_dir(directory: Path, toy_cfg: dict) -> None:
    from safetensors.torch import save_file

    seed = toy_cfg["seed"]
    conversations = synthetic_conversations(CONVERSATIONS_PER_BUILD, seed)
    tokenizer = train_tokenizer(_tokenizer_texts(conversations), toy_cfg["vocab_size"])
    config = model_config(toy_cfg, tokenizer)
    samples = encode_for_training(conversations, tokenizer)
    with _DeterministicTorch():
        weights, final_loss = train_model(config, samples, toy_cfg["train_steps"], seed)

    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "model.safetensors").chmod(0o644)  # safetensors may create it private
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", {
        "eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"],
    })
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", _tokenizer_config(tokenizer))
    _write_json(directory / "special_tokens_map.json", {
        "eos_token": END, "pad_token": PAD, "additional_special_tokens": [SYSTEM, USER, ASSISTANT],
    })
    _write_json(directory / "toy_build.json", {
        "toy_cfg": toy_cfg, "conversations": len(conversations), "batch_size": BATCH_SIZE,
        "tokenizer_vocab": tokenizer.get_vocab_size(), "final_train_loss": final_loss,
    })


def build_toy_target(out_dir: Path, toy_cfg: dict) -> Path:
    """Build the toy reasoning target into ``out_dir`` and return it.

    ``toy_cfg`` is the ``target.toy`` config section (missing keys take the schema defaults).
    The directory is assembled next to ``out_dir`` and renamed into place at the end, so an
    interrupted build never leaves a half-written target.
    """
    toy_cfg = resolve_section("target.toy", toy_cfg)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as partial:
        _write_model_dir(partial, toy_cfg)
    return out_dir
