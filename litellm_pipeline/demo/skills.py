"""The demo model's synthetic skills corpus: small tasks whose answers are exact and checkable.

| task      | prompt             | answer  |
|-----------|--------------------|---------|
| `add`     | `12+345=`          | `357`   |  two numbers of 1-3 digits
| `reverse` | `rev:abcde=`       | `edcba` |  3-8 lowercase letters
| `sort`    | `sort:3917=`       | `1379`  |  3-8 digits
| `copy`    | `copy:x7z=`        | `x7z`   |  3-8 lowercase letters and digits
| `recall`  | `a3,b7,c1;b`       | `7`     |  2-4 distinct keys, each followed by its digit

Recall is laid out as the associative-recall benchmarks lay it out (key and value adjacent, the prompt ending in
the key asked), so the answer is the token that followed the earlier occurrence of the last token: the induction
mechanism that copying needs too. A recall training sequence may ask several of its keys in turn
(``a3,b7,c1;b7;c1;a3``, :func:`with_followups`): binding keys to values is the slowest skill to learn, and each
further question is one more scored answer from the same context. Every prompt belongs to exactly one
split, decided by a hash of the prompt text (:func:`split_of`), so held-out examples can never appear in training
whatever the seeds; a recall sequence asks only questions whose single-question prompt is in the training split.
Everything is drawn from :class:`random.Random` seeded with strings, which is stable across runs and platforms.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

Split = Literal["train", "eval"]

TASKS = ("add", "reverse", "sort", "copy", "recall")
# every character a prompt or an answer may hold (the tokenizer's vocabulary, besides its specials)
CHARSET = string.digits + string.ascii_lowercase + "+=:,;? "
EVAL_PERCENT = 10  # share of the prompt space held out for evaluation
DEFAULT_EVAL_SEED = 1234


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str
    # training only: further (question, answer) turns after the answer; only their answers are scored
    followups: tuple[tuple[str, str], ...] = ()


def _add(rng: random.Random) -> tuple[str, str]:
    def number() -> int:
        digits = rng.randint(1, 3)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    a, b = number(), number()
    return f"{a}+{b}=", str(a + b)


def _letters(rng: random.Random, alphabet: str) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 8)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    s = _letters(rng, string.ascii_lowercase)
    return f"rev:{s}=", s[::-1]


def _sort(rng: random.Random) -> tuple[str, str]:
    s = _letters(rng, string.digits)
    return f"sort:{s}=", "".join(sorted(s))


def _copy(rng: random.Random) -> tuple[str, str]:
    s = _letters(rng, string.ascii_lowercase + string.digits)
    return f"copy:{s}=", s


def _recall(rng: random.Random) -> tuple[str, str]:
    keys = rng.sample(string.ascii_lowercase, rng.randint(2, 4))
    values = [rng.choice(string.digits) for _ in keys]
    q = rng.randrange(len(keys))
    pairs = ",".join(f"{k}{v}" for k, v in zip(keys, values))
    return f"{pairs};{keys[q]}", values[q]


_MAKERS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": _add,
    "reverse": _reverse,
    "sort": _sort,
    "copy": _copy,
    "recall": _recall,
}


def split_of(prompt: str) -> Split:
    """The split a prompt belongs to: a fixed hash bucket, independent of any seed."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % 100
    return "eval" if bucket < EVAL_PERCENT else "train"


def make_example(task: str, rng: random.Random, split: Split) -> Example:
    """One example of ``task`` from ``split`` (draws until the prompt hashes into that split)."""
    maker = _MAKERS[task]
    while True:
        prompt, answer = maker(rng)
        if split_of(prompt) == split:
            return Example(task, prompt, answer)


def check_tasks(tasks: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    unknown = [t for t in tasks if t not in _MAKERS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known tasks: {', '.join(TASKS)}")
    return tuple(tasks)


def heldout(per_task: int, seed: int = DEFAULT_EVAL_SEED, tasks: tuple[str, ...] = TASKS) -> list[Example]:
    """``per_task`` distinct held-out examples of each task, task by task; the same list for the same seed."""
    out = []
    for task in check_tasks(tasks):
        rng = random.Random(f"eval:{seed}:{task}")
        seen: set[str] = set()
        for _ in range(per_task * 50):  # the smallest task space holds thousands of eval prompts
            if len(seen) == per_task:
                break
            ex = make_example(task, rng, "eval")
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                out.append(ex)
    return out


def with_followups(ex: Example, rng: random.Random, questions: int) -> Example:
    """A recall example that goes on to ask up to ``questions - 1`` of its other keys (``;c`` -> ``1``), in a
    random order; a key is asked only if its single-question prompt is in the training split. Other tasks: as is."""
    if ex.task != "recall" or questions <= 1:
        return ex
    pairs, first = ex.prompt.split(";")
    table = [(kv[0], kv[1]) for kv in pairs.split(",") if kv[0] != first]
    rng.shuffle(table)
    asked = [(f";{k}", v) for k, v in table if split_of(f"{pairs};{k}") == "train"]
    return Example(ex.task, ex.prompt, ex.answer, tuple(asked[: questions - 1]))


def training_stream(seed: int, tasks: dict[str, float] | tuple[str, ...] = TASKS,
                    recall_questions: int = 1) -> Iterator[Example]:
    """An endless, seeded stream of training examples; ``tasks`` maps task -> sampling weight (or lists tasks);
    recall examples ask up to ``recall_questions`` questions of one context (:func:`with_followups`)."""
    rng = random.Random(f"train:{seed}")
    weights = dict(tasks) if isinstance(tasks, dict) else dict.fromkeys(tasks, 1.0)
    names = check_tasks(list(weights))
    w = [weights[t] for t in names]
    while True:
        yield with_followups(make_example(rng.choices(names, w)[0], rng, "train"), rng, recall_questions)


_PATTERNS: list[tuple[str, re.Pattern, Callable[[re.Match], str]]] = [
    ("add", re.compile(r"(\d+)\+(\d+)="), lambda m: str(int(m[1]) + int(m[2]))),
    ("reverse", re.compile(r"rev:([a-z]+)="), lambda m: m[1][::-1]),
    ("sort", re.compile(r"sort:(\d+)="), lambda m: "".join(sorted(m[1]))),
    ("copy", re.compile(r"copy:([a-z0-9]+)="), lambda m: m[1]),
    ("recall", re.compile(r"((?:[a-z]\d,)*[a-z]\d);([a-z])"),
     lambda m: {p[0]: p[1] for p in m[1].split(",")}.get(m[2])),
]


def solve(prompt: str) -> tuple[str, str] | None:
    """(task, exact answer) for a prompt written in one of the task formats, else None."""
    for task, pattern, answer in _PATTERNS:
        m = pattern.fullmatch(prompt)
        if m:
            expected = answer(m)
            return None if expected is None else (task, expected)
    return None
