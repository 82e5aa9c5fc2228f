"""`bench latency --workload repeat`: prompts the model must largely copy ("rewrite this
paragraph, changing only the names"), the home ground of n-gram speculation.

Each timed run gets its own paragraph (other names, other places), so no run hits a prefix
cache filled by an earlier one beyond the shared chat-template head.
"""

from __future__ import annotations

import random

PARAGRAPH = (
    "{a} moved to {city} in the spring of {year} to work at a small bakery near the river. Every morning {a_first} "
    "opened the shop at six, and a colleague, {b}, brought the bread from the oven. On weekends {a_first} and "
    "{b_first} walked along the coast, and {b_first} told {a_first} stories about a grandfather who had been a "
    "fisherman in the north. In the evenings they counted the money, swept the floor, wrote the orders for the next "
    "day and locked the door at nine. {a_first} liked the quiet of the empty street, and {b_first} liked the smell of "
    "the last loaves cooling on the racks.")
INSTRUCTION = ("Rewrite this paragraph, changing only the names ({a} becomes {c}, {b} becomes {d}). Keep every "
               "other word the same.\n\n")
FIRST = ["Alice", "Tom", "Maria", "Jan", "Chen", "Amara", "Lukas", "Priya", "Omar", "Sofia", "Kenji", "Ingrid"]
LAST = ["Morgan", "Becker", "Santos", "Novak", "Wei", "Okafor", "Weber", "Sharma", "Haddad", "Rossi", "Sato", "Berg"]
CITIES = ["Lisbon", "Porto", "Ghent", "Bergen", "Split", "Tartu", "Cork", "Bari", "Lyon", "Graz"]


def repeat_prompts(model_dir: str, num: int, seed: int) -> list[list[int]]:
    """`num` chat prompts (token ids, with the model's chat template) asking for a rewrite of a
    ~150-token paragraph with two names swapped."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        a, b, c, d = (f"{f} {s}" for f, s in zip(rng.sample(FIRST, 4), rng.sample(LAST, 4), strict=True))
        text = PARAGRAPH.format(a=a, b=b, a_first=a.split()[0], b_first=b.split()[0], city=rng.choice(CITIES),
                                year=rng.randrange(1990, 2024))
        message = INSTRUCTION.format(a=a, b=b, c=c, d=d) + text
        ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                            tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids))
    return prompts
