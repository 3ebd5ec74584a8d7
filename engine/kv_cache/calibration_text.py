"""The real text int8 KV scales are calibrated on (:mod:`pdserve.engine.kv_cache.int8_scales`).

Five short passages of different kinds, so keys and values see prose, speech, technical
writing, code and numbers: Lincoln's Gettysburg Address (1863, public domain), the opening of
Jane Austen's *Pride and Prejudice* (1813, public domain), and three passages written for
pdserve (a technical explanation, a Python function, a table of figures). About 1,300 words,
2,000-3,000 tokens with common tokenizers. The held-out evaluation set of
``python -m pdserve.bench.kv_int8`` (:mod:`pdserve.bench.kv_eval_text`) shares no passage.
"""

from __future__ import annotations

CALIBRATION_TEXTS: tuple[str, ...] = (
    # Abraham Lincoln, the Gettysburg Address (Bliss copy), 1863.
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal.\n"
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so "
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that "
    "war. We have come to dedicate a portion of that field, as a final resting place for those "
    "who here gave their lives that that nation might live. It is altogether fitting and proper "
    "that we should do this.\nBut, in a larger sense, we can not dedicate -- we can not "
    "consecrate -- we can not hallow -- this ground. The brave men, living and dead, who "
    "struggled here, have consecrated it, far above our poor power to add or detract. The world "
    "will little note, nor long remember what we say here, but it can never forget what they "
    "did here. It is for us the living, rather, to be dedicated here to the unfinished work "
    "which they who fought here have thus far so nobly advanced. It is rather for us to be here "
    "dedicated to the great task remaining before us -- that from these honored dead we take "
    "increased devotion to that cause for which they gave the last full measure of devotion -- "
    "that we here highly resolve that these dead shall not have died in vain -- that this "
    "nation, under God, shall have a new birth of freedom -- and that government of the people, "
    "by the people, for the people, shall not perish from the earth.\n",
    # Jane Austen, Pride and Prejudice, chapter 1 (opening), 1813.
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife.\nHowever little known the feelings or views of such a "
    "man may be on his first entering a neighbourhood, this truth is so well fixed in the minds "
    "of the surrounding families, that he is considered the rightful property of some one or "
    "other of their daughters.\n\"My dear Mr. Bennet,\" said his lady to him one day, \"have you "
    "heard that Netherfield Park is let at last?\"\nMr. Bennet replied that he had not.\n\"But "
    "it is,\" returned she; \"for Mrs. Long has just been here, and she told me all about "
    "it.\"\nMr. Bennet made no answer.\n\"Do you not want to know who has taken it?\" cried his "
    "wife impatiently.\n\"You want to tell me, and I have no objection to hearing it.\"\nThis "
    "was invitation enough.\n\"Why, my dear, you must know, Mrs. Long says that Netherfield is "
    "taken by a young man of large fortune from the north of England; that he came down on "
    "Monday in a chaise and four to see the place, and was so much delighted with it that he "
    "agreed with Mr. Morris immediately; that he is to take possession before Michaelmas, and "
    "some of his servants are to be in the house by the end of next week.\"\n",
    # Written for pdserve: a technical explanation.
    "A transformer language model reads its prompt as a sequence of tokens. Every layer turns "
    "each token into a query, a key and a value vector. The query of the newest token is "
    "compared with the keys of all earlier tokens; the resulting weights, after a softmax, mix "
    "the earlier values into a single vector that the rest of the layer refines. Because the "
    "keys and values of earlier tokens never change, a serving engine keeps them in a cache and "
    "computes only the newest token at every step. That cache grows with every token of every "
    "request, and on a busy server it, not the model weights, decides how many requests fit in "
    "memory at once. Storing it in eight-bit integers instead of sixteen-bit floats halves its "
    "size, at the price of a small rounding error in every key and value. Whether that error "
    "matters depends on how the integers are scaled: keys tend to have a few channels whose "
    "values are always large, while values vary more from token to token.\n",
    # Written for pdserve: Python code.
    "def top_k_sample(logits, k=50, temperature=0.8, generator=None):\n"
    "    \"\"\"Sample one token id from the k most likely ones.\"\"\"\n"
    "    if temperature <= 0:\n"
    "        return int(logits.argmax())\n"
    "    values, indices = torch.topk(logits / temperature, k)\n"
    "    probs = torch.softmax(values, dim=-1)\n"
    "    choice = torch.multinomial(probs, num_samples=1, generator=generator)\n"
    "    return int(indices[choice])\n\n"
    "class RunningMean:\n"
    "    def __init__(self):\n"
    "        self.count, self.total = 0, 0.0\n\n"
    "    def add(self, value: float) -> None:\n"
    "        self.count += 1\n"
    "        self.total += value\n\n"
    "    @property\n"
    "    def mean(self) -> float:\n"
    "        return self.total / max(self.count, 1)\n",
    # Written for pdserve: figures.
    "Monthly rainfall in millimetres, 2021 to 2023:\n"
    "| month | 2021 | 2022 | 2023 |\n|---|---|---|---|\n"
    "| January | 78.4 | 91.2 | 64.0 |\n| February | 55.1 | 47.9 | 70.3 |\n"
    "| March | 60.8 | 38.5 | 82.6 |\n| April | 41.7 | 52.0 | 49.9 |\n"
    "| May | 66.3 | 71.4 | 58.2 |\n| June | 49.0 | 63.8 | 35.7 |\n"
    "The wettest month was January 2022 with 91.2 mm; the driest, June 2023 with 35.7 mm. "
    "Totals: 351.3 mm (2021), 364.8 mm (2022) and 360.7 mm (2023), an average of 358.9 mm.\n",
)
