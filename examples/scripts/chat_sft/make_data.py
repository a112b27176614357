"""Writes `chat.jsonl`: small synthetic chat conversations (arithmetic, word games, a few facts), one JSON
object a line, `{"messages": [{"role": "user", "content": …}, {"role": "assistant", "content": …}, …]}`.

    python make_data.py --out chat.jsonl --count 400
"""

import argparse
import json
import random

WORDS = ["river", "engine", "garden", "copper", "lantern", "meadow", "signal", "harbor", "pencil", "orbit",
         "velvet", "canyon", "thunder", "marble", "saddle", "window", "glacier", "ember", "falcon", "quartz"]
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
            "Egypt": "Cairo", "Canada": "Ottawa", "Chile": "Santiago", "India": "New Delhi", "Spain": "Madrid"}


def turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        words = rng.sample(WORDS, rng.randint(2, 5))
        return f"Reverse these words: {' '.join(words)}", " ".join(reversed(words))
    if kind == 2:
        country = rng.choice(sorted(CAPITALS))
        return f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."
    word = rng.choice(WORDS)
    return f"Spell '{word}' letter by letter.", "-".join(word.upper())


def conversation(rng: random.Random) -> dict:
    messages = []
    for _ in range(rng.randint(1, 3)):
        question, answer = turn(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="chat.jsonl")
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for _ in range(args.count):
            f.write(json.dumps(conversation(rng)) + "\n")


if __name__ == "__main__":
    main()
