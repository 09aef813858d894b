#!/usr/bin/env python3
"""Generate the reference trainer's shipped corpus: src/trainguard/trainer/corpus/corpus.txt.gz.

The text is synthetic so that it is license-clean and needs no download. It is built to be
*learnable*: a small vocabulary, rigid templates, number words with real arithmetic, a fixed cast of
characters whose facts never change, calendars and counting lists. A tiny model's loss falls quickly
on it, which is what the demo and the guard tests need.

Format: plain ASCII, documents separated by one blank line (no document contains a blank line).
Output is byte-for-byte deterministic (fixed seed, gzip mtime 0, no file name in the gzip header),
so re-running it reproduces the committed file exactly.

Run from the repository root:  python tools/make_corpus.py
"""

from __future__ import annotations

import argparse
import gzip
import io
import random
from dataclasses import dataclass
from pathlib import Path

SEED = 20240611
TARGET_BYTES = 2_000_000
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src/trainguard/trainer/corpus/corpus.txt.gz"

# ---------------------------------------------------------------- numbers, ordinals, calendar

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
         "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_ORD_ONES = ["zeroth", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
             "ninth", "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth",
             "sixteenth", "seventeenth", "eighteenth", "nineteenth"]
_ORD_TENS = ["", "", "twentieth", "thirtieth", "fortieth", "fiftieth", "sixtieth", "seventieth",
             "eightieth", "ninetieth"]


def num(n: int) -> str:
    if n < 20:
        return _ONES[n]
    if n < 100:
        t, o = divmod(n, 10)
        return _TENS[t] + ("" if o == 0 else "-" + _ONES[o])
    if n == 100:
        return "one hundred"
    raise ValueError(n)


def ordinal(n: int) -> str:
    if n < 20:
        return _ORD_ONES[n]
    t, o = divmod(n, 10)
    return _ORD_TENS[t] if o == 0 else _TENS[t] + "-" + _ORD_ONES[o]


DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september",
          "october", "november", "december"]
MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
SEASONS = {"winter": ["december", "january", "february"], "spring": ["march", "april", "may"],
           "summer": ["june", "july", "august"], "autumn": ["september", "october", "november"]}
COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown", "orange", "purple", "gray"]

# ---------------------------------------------------------------- the recurring cast


@dataclass(frozen=True)
class Person:
    name: str
    he: str  # subject pronoun
    his: str  # possessive
    him: str  # object pronoun
    age: int
    town: str
    pet_kind: str
    pet_name: str
    food: str  # plural noun
    color: str
    job: str
    birth_day: int
    birth_month: str


# Fixed facts a model can memorize: each name always comes with the same town, pet, food, and so on.
CAST = [
    Person("Anna", "she", "her", "her", 7, "Oakvale", "dog", "Rex", "apples", "red", "student", 4, "april"),
    Person("Ben", "he", "his", "him", 8, "Oakvale", "cat", "Tom", "pears", "blue", "student", 12, "june"),
    Person("Clara", "she", "her", "her", 30, "Millbrook", "bird", "Pip", "carrots", "green", "baker", 21, "march"),
    Person("David", "he", "his", "him", 35, "Millbrook", "horse", "Star", "plums", "brown", "farmer", 9, "october"),
    Person("Emma", "she", "her", "her", 6, "Riverton", "rabbit", "Hop", "grapes", "yellow", "student", 30, "may"),
    Person("Felix", "he", "his", "him", 40, "Riverton", "dog", "Max", "onions", "black", "doctor", 2, "february"),
    Person("Grace", "she", "her", "her", 28, "Stonehill", "cat", "Luna", "lemons", "purple", "teacher", 17, "july"),
    Person("Henry", "he", "his", "him", 9, "Stonehill", "fish", "Bubbles", "cherries", "orange", "student", 25, "december"),
    Person("Iris", "she", "her", "her", 33, "Oakvale", "goat", "Daisy", "beans", "white", "painter", 11, "september"),
    Person("Jack", "he", "his", "him", 45, "Millbrook", "dog", "Bruno", "potatoes", "gray", "driver", 6, "january"),
    Person("Kate", "she", "her", "her", 10, "Riverton", "cat", "Misty", "peaches", "green", "student", 19, "august"),
    Person("Leo", "he", "his", "him", 52, "Stonehill", "bird", "Sunny", "tomatoes", "red", "fisher", 28, "november"),
    Person("Mia", "she", "her", "her", 8, "Millbrook", "rabbit", "Snow", "berries", "blue", "student", 3, "march"),
    Person("Noah", "he", "his", "him", 31, "Oakvale", "horse", "Thunder", "melons", "yellow", "builder", 14, "may"),
    Person("Olivia", "she", "her", "her", 37, "Riverton", "dog", "Pepper", "oranges", "orange", "nurse", 22, "october"),
    Person("Peter", "he", "his", "him", 7, "Stonehill", "cat", "Ginger", "figs", "purple", "student", 8, "april"),
]
TOWNS = sorted({p.town for p in CAST})
TOWN_FACTS = {"Oakvale": "a big oak tree", "Millbrook": "an old mill", "Riverton": "a long bridge",
              "Stonehill": "a stone tower"}
PET_SOUNDS = {"dog": "barks", "cat": "meows", "bird": "sings", "horse": "neighs", "rabbit": "hops",
              "fish": "swims", "goat": "bleats"}
PET_SOUNDS_PAST = {"dog": "barked", "cat": "meowed", "bird": "sang", "horse": "neighed", "rabbit": "hopped",
                   "fish": "swam", "goat": "bleated"}
JOB_PLACE = {"student": "the school", "baker": "the bakery", "farmer": "the farm", "doctor": "the clinic",
             "teacher": "the school", "painter": "the studio", "driver": "the bus station",
             "fisher": "the harbor", "builder": "the building site", "nurse": "the clinic"}

# ---------------------------------------------------------------- agreement vocabulary

# (singular, plural) pairs so templates can agree in number.
ANIMALS = [("dog", "dogs"), ("cat", "cats"), ("bird", "birds"), ("horse", "horses"), ("mouse", "mice"),
           ("fox", "foxes"), ("sheep", "sheep"), ("duck", "ducks"), ("cow", "cows"), ("goat", "goats")]
PEOPLE = [("child", "children"), ("man", "men"), ("woman", "women"), ("boy", "boys"), ("girl", "girls"),
          ("farmer", "farmers"), ("teacher", "teachers"), ("baker", "bakers")]
THINGS = [("apple", "apples"), ("box", "boxes"), ("book", "books"), ("ball", "balls"), ("cup", "cups"),
          ("egg", "eggs"), ("hat", "hats"), ("key", "keys"), ("stone", "stones"), ("shoe", "shoes"),
          ("pencil", "pencils"), ("cake", "cakes"), ("leaf", "leaves"), ("coin", "coins")]
# (third person singular, base, past)
VERBS_INTR = [("runs", "run", "ran"), ("sleeps", "sleep", "slept"), ("sits", "sit", "sat"),
              ("plays", "play", "played"), ("waits", "wait", "waited"), ("jumps", "jump", "jumped"),
              ("walks", "walk", "walked"), ("rests", "rest", "rested")]
VERBS_TR = [("sees", "see", "saw"), ("likes", "like", "liked"), ("finds", "find", "found"),
            ("carries", "carry", "carried"), ("wants", "want", "wanted"), ("holds", "hold", "held")]
PLACES = ["the garden", "the barn", "the park", "the field", "the kitchen", "the yard", "the forest",
          "the hill", "the river", "the market"]
PREPS = ["in", "near", "behind", "beside"]
ADJS = ["happy", "small", "big", "quiet", "hungry", "tired", "old", "young", "clever", "busy"]


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


SHE_NOUNS = {"woman", "girl"}
HE_NOUNS = {"man", "boy"}


def np_phrase(rng: random.Random, pool: list[tuple[str, str]]) -> tuple[str, bool, str]:
    """A noun phrase, whether it is plural, and the pronoun that refers back to it."""
    sing, plur = rng.choice(pool)
    plural = rng.random() < 0.5
    if plural:
        return rng.choice(["the " + plur, num(rng.randint(2, 9)) + " " + plur, "some " + plur]), True, "they"
    if pool is PEOPLE:
        pron = "she" if sing in SHE_NOUNS else "he" if sing in HE_NOUNS else rng.choice(["he", "she"])
    else:
        pron = "it"
    adj = rng.choice(ADJS)
    phrase = rng.choice(["the " + sing, ("an " if sing[0] in "aeiou" else "a ") + sing,
                         ("an " if adj[0] in "aeiou" else "a ") + adj + " " + sing, "the " + adj + " " + sing])
    return phrase, False, pron


def count_noun(n: int, pair: tuple[str, str]) -> str:
    return num(n) + " " + (pair[0] if n == 1 else pair[1])


# ---------------------------------------------------------------- document kinds


def doc_arithmetic(rng: random.Random) -> str:
    lines = [rng.choice(["Sums.", "Arithmetic practice.", "Number facts.", "Math lesson."])]
    for _ in range(rng.randint(6, 14)):
        op = rng.choice(["plus", "plus", "minus", "times", "question", "after", "double", "compare"])
        if op == "plus":
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            lines.append(f"{cap(num(a))} plus {num(b)} is {num(a + b)}.")
        elif op == "minus":
            a = rng.randint(0, 100)
            b = rng.randint(0, a)
            lines.append(f"{cap(num(a))} minus {num(b)} is {num(a - b)}.")
        elif op == "times":
            a, b = rng.randint(0, 10), rng.randint(0, 10)
            lines.append(f"{cap(num(a))} times {num(b)} is {num(a * b)}.")
        elif op == "question":
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            lines.append(f"What is {num(a)} plus {num(b)}? It is {num(a + b)}.")
        elif op == "after":
            a = rng.randint(0, 98)
            lines.append(f"The number after {num(a)} is {num(a + 1)}, and the number before "
                         f"{num(a + 1)} is {num(a)}.")
        elif op == "double":
            a = rng.randint(0, 50)
            lines.append(f"Double {num(a)} is {num(2 * a)}.")
        else:
            a, b = rng.sample(range(0, 101), 2)
            word = "more" if a > b else "less"
            lines.append(f"{cap(num(a))} is {word} than {num(b)}.")
    return "\n".join(lines)


def doc_counting(rng: random.Random) -> str:
    start = rng.randint(0, 80)
    step = rng.choice([1, 1, 1, 2, 5, 10])
    seq = [n for n in range(start, 101, step)][: rng.randint(5, 15)]
    lines = [f"Counting by {num(step)}s from {num(start)}:" if step > 1 else f"Counting from {num(start)}:",
             ", ".join(num(n) for n in seq) + "."]
    if rng.random() < 0.5:
        lines.append(f"That is {count_noun(len(seq), ('number', 'numbers'))}.")
    if rng.random() < 0.5:
        down = list(range(rng.randint(3, 12), -1, -1))
        lines.append("Counting down: " + ", ".join(num(n) for n in down) + ". Go!")
    return "\n".join(lines)


def doc_calendar(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(5, 10)):
        kind = rng.choice(["day_after", "day_before", "month_after", "month_days", "season", "list", "date"])
        if kind == "day_after":
            i = rng.randrange(7)
            lines.append(f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}.")
        elif kind == "day_before":
            i = rng.randrange(7)
            lines.append(f"The day before {DAYS[i]} is {DAYS[i - 1]}.")
        elif kind == "month_after":
            i = rng.randrange(12)
            lines.append(f"{cap(MONTHS[(i + 1) % 12])} comes after {MONTHS[i]}.")
        elif kind == "month_days":
            i = rng.randrange(12)
            lines.append(f"{cap(MONTHS[i])} has {num(MONTH_DAYS[i])} days.")
        elif kind == "season":
            season, months = rng.choice(list(SEASONS.items()))
            lines.append(f"The months of {season} are {months[0]}, {months[1]} and {months[2]}.")
        elif kind == "list":
            if rng.random() < 0.5:
                lines.append("The days of the week are " + ", ".join(DAYS[:-1]) + " and " + DAYS[-1] + ".")
            else:
                lines.append("The months of the year are " + ", ".join(MONTHS[:-1]) + " and " + MONTHS[-1] + ".")
        else:
            m = rng.randrange(12)
            d = rng.randint(1, MONTH_DAYS[m])
            nxt = (m, d + 1) if d < MONTH_DAYS[m] else ((m + 1) % 12, 1)
            lines.append(f"The day after the {ordinal(d)} of {MONTHS[m]} is the "
                         f"{ordinal(nxt[1])} of {MONTHS[nxt[0]]}.")
    return "\n".join(lines)


def doc_sentences(rng: random.Random) -> str:
    """Templated sentences whose verbs and nouns must agree with the subject's number."""
    lines = []
    for _ in range(rng.randint(6, 12)):
        t = rng.randrange(6)
        subj, plural, pron = np_phrase(rng, rng.choice([ANIMALS, PEOPLE]))
        be = "are" if plural else "is"
        if t == 0:
            v = rng.choice(VERBS_INTR)
            lines.append(f"{cap(subj)} {v[1] if plural else v[0]} {rng.choice(PREPS)} {rng.choice(PLACES)}.")
        elif t == 1:
            lines.append(f"{cap(subj)} {be} {rng.choice(ADJS)}.")
        elif t == 2:
            n = rng.randint(1, 12)
            lines.append(f"{cap(subj)} {'have' if plural else 'has'} {count_noun(n, rng.choice(THINGS))}.")
        elif t == 3:
            v = rng.choice(VERBS_TR)
            obj, _, _ = np_phrase(rng, THINGS)
            lines.append(f"{cap(subj)} {v[1] if plural else v[0]} {obj}.")
        elif t == 4:
            v = rng.choice(VERBS_INTR)
            lines.append(f"Yesterday {subj} {'were' if plural else 'was'} {rng.choice(ADJS)} and {v[2]} "
                         f"{rng.choice(PREPS)} {rng.choice(PLACES)}.")
        else:
            lines.append(f"{cap(subj)} {be} {rng.choice(PREPS)} {rng.choice(PLACES)}, and {pron} "
                         f"{'look' if plural else 'looks'} {rng.choice(ADJS)}.")
    return "\n".join(lines)


def doc_profile(rng: random.Random) -> str:
    """Facts about one cast member, in shuffled order: the same facts every time."""
    p = rng.choice(CAST)
    facts = [
        f"{p.name} is {num(p.age)} years old.",
        f"{p.name} lives in {p.town}. In {p.town} there is {TOWN_FACTS[p.town]}.",
        f"{p.name} has a {p.pet_kind} named {p.pet_name}. {p.pet_name} {PET_SOUNDS[p.pet_kind]}.",
        f"{cap(p.his)} favorite food is {p.food}.",
        f"{cap(p.his)} favorite color is {p.color}.",
        f"{p.name} is a {p.job} and goes to {JOB_PLACE[p.job]} every day.",
        f"{p.name} was born on the {ordinal(p.birth_day)} of {p.birth_month}.",
    ]
    rng.shuffle(facts)
    return f"About {p.name}.\n" + "\n".join(facts[: rng.randint(4, len(facts))])


def doc_story(rng: random.Random) -> str:
    a, b = rng.sample(CAST, 2)
    day = rng.randrange(7)
    item = rng.choice(THINGS)
    n = rng.randint(2, 9)
    give = rng.randint(1, n - 1)
    lines = [
        f"Once upon a time, on a {DAYS[day]}, {a.name} went to {rng.choice(PLACES)} with {a.his} "
        f"{a.pet_kind} {a.pet_name}.",
        f"{a.name} had {count_noun(n, item)}.",
        f"There {a.he} met {b.name}, who lives in {b.town}.",
        f"{a.name} gave {b.name} {count_noun(give, item)}.",
        f"Now {a.name} has {count_noun(n - give, item)} and {b.name} has {count_noun(give, item)}.",
    ]
    if rng.random() < 0.6:
        more = rng.randint(1, 5)
        lines.append(f"Then {b.name} found {count_noun(more, item)} more, so {b.he} had "
                     f"{count_noun(give + more, item)}.")
    if rng.random() < 0.6:
        lines.append(f"{b.name} shared some {b.food} with {a.name}, because {b.food} are {b.his} favorite food.")
    if rng.random() < 0.5:
        lines.append(f"{a.pet_name} the {a.pet_kind} {PET_SOUNDS_PAST[a.pet_kind]} and {a.name} laughed.")
    lines.append(f"The next day was {DAYS[(day + 1) % 7]}, and {a.name} went home to {a.town}.")
    lines.append("The end.")
    return "\n".join(lines)


def doc_list(rng: random.Random) -> str:
    p = rng.choice(CAST)
    items = rng.sample(THINGS, rng.randint(3, 7))
    counts = [rng.randint(1, 9) for _ in items]
    lines = [f"{p.name}'s shopping list:"]
    lines += [f"- {count_noun(c, it)}" for c, it in zip(counts, items)]
    lines.append(f"That is {count_noun(len(items), ('line', 'lines'))} and "
                 f"{count_noun(sum(counts), ('thing', 'things'))} in all.")
    if rng.random() < 0.5:
        lines.append(f"The colors {p.name} likes, in order: " +
                     ", ".join([p.color] + rng.sample([c for c in COLORS if c != p.color], 2)) + ".")
    return "\n".join(lines)


def doc_qa(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(4, 8)):
        p = rng.choice(CAST)
        q = rng.randrange(6)
        if q == 0:
            lines.append(f"Q: Where does {p.name} live? A: {p.name} lives in {p.town}.")
        elif q == 1:
            lines.append(f"Q: What is the name of {p.name}'s {p.pet_kind}? A: It is {p.pet_name}.")
        elif q == 2:
            lines.append(f"Q: How old is {p.name}? A: {cap(p.he)} is {num(p.age)}.")
        elif q == 3:
            lines.append(f"Q: When was {p.name} born? A: On the {ordinal(p.birth_day)} of {p.birth_month}.")
        elif q == 4:
            lines.append(f"Q: What does {p.name} do? A: {cap(p.he)} is a {p.job}.")
        else:
            others = [o.name for o in CAST if o.town == p.town and o is not p]
            lines.append(f"Q: Who lives in {p.town}? A: " + ", ".join(sorted(others + [p.name])[:-1]) +
                         " and " + sorted(others + [p.name])[-1] + ".")
    return "\n".join(lines)


KINDS = [(doc_arithmetic, 3), (doc_counting, 1), (doc_calendar, 2), (doc_sentences, 3),
         (doc_profile, 2), (doc_story, 4), (doc_list, 1), (doc_qa, 2)]


def generate(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> str:
    rng = random.Random(seed)
    funcs = [f for f, _ in KINDS]
    weights = [w for _, w in KINDS]
    docs: list[str] = []
    size = 0
    while size < target_bytes:
        doc = rng.choices(funcs, weights)[0](rng)
        assert doc.isascii() and "\n\n" not in doc
        docs.append(doc)
        size += len(doc) + 2
    return "\n\n".join(docs) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--bytes", type=int, default=TARGET_BYTES)
    args = ap.parse_args()
    data = generate(args.seed, args.bytes).encode("ascii")
    buf = io.BytesIO()
    # mtime=0 and an empty file name keep the .gz byte-identical across runs and machines.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(buf.getvalue())
    n_docs = data.count(b"\n\n") + 1
    print(f"wrote {args.out}: {len(data)} bytes of text, {len(buf.getvalue())} bytes gzipped, {n_docs} documents")


if __name__ == "__main__":
    main()
