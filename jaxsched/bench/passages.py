"""The copy workload's text: chat prompts that ask the model to repeat, or lightly edit, a passage.

Outputs that copy their prompt are what prompt lookup (speculative decoding, core/ngram.py) serves
best: editing, retrieval, code. A passage is a run of the sentences below (plain prose written for
this benchmark), drawn at random until it has the wanted number of tokens; the instruction asks for
it back word for word, or with one light change, so the answer still follows it closely.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SENTENCES = (
    "The river rose slowly through the night, and by morning the lower fields were under water.",
    "Farmers moved their animals to the high ground before the sun came up.",
    "The old bridge held, although the water reached the bottom of its stone arches.",
    "In the village, people carried bags of sand to the doors of the houses nearest the bank.",
    "A small boat went from house to house to bring bread and clean water to those who stayed.",
    "By noon the rain had stopped, and the clouds broke apart over the hills to the west.",
    "Children stood on the wall by the church and watched the brown water move past.",
    "The mayor said that the road to the market town would stay closed for at least two days.",
    "Engineers from the city came in the afternoon to look at the damage to the dam.",
    "They found a crack in the concrete, but it was not deep enough to be dangerous.",
    "The school opened its doors so that families from the lowest streets had a dry place to sleep.",
    "Volunteers cooked soup in large pots and served it to anyone who came in from the cold.",
    "When the water began to fall, it left a line of mud on every wall it had touched.",
    "It took most of a week to clean the houses and to dry the floors and the furniture.",
    "The farmers lost part of their harvest, but most of the animals were safe.",
    "A month later, the council voted to build a higher wall along the river.",
    "The work started in the spring and was finished before the next autumn rains.",
    "Since then the village has not flooded, even in the wettest years.",
    "Every year, on the day the water was highest, the people meet by the bridge to remember it.",
    "Some of the older people still tell the story of the night the river came into the town.",
    "The library keeps photographs of the flood in a glass case near the entrance.",
    "Visitors often stop to look at them before they walk down to see the new wall.",
    "A small garden now grows where the lowest houses once stood.",
    "In summer the river is quiet again, and children swim in it below the bridge.",
)

INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word, and write nothing else.",
    "Copy the following passage, but write every number as a digit. Change nothing else.",
    "Rewrite the following passage with a short title line first, then the passage unchanged.",
)


def copy_prompts(tokenizer: Any, n: int, min_tokens: int, max_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """n chat prompts (token ids, rendered with the tokenizer's chat template), each asking to copy
    a passage of min_tokens..max_tokens tokens, with the passage's length in tokens (the output
    needs about as many)."""
    from jaxsched.engine.tokenizer import chat_prompt_ids

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        want = int(rng.integers(min_tokens, max_tokens + 1))
        order = rng.permutation(len(SENTENCES))
        picked: list[str] = []
        size = 0
        for j in order:
            if size >= want:
                break
            picked.append(SENTENCES[j])
            size = len(tokenizer.encode(" ".join(picked), add_special_tokens=False))
        passage = " ".join(picked)
        chat = [{"role": "user", "content": f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{passage}"}]
        out.append((chat_prompt_ids(tokenizer, chat), size))
    return out
