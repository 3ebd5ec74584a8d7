"""Held-out text for ``python -m pdserve.bench.kv_int8`` (none of it is calibration text).

Passages of different kinds: the openings of Dickens' *A Tale of Two Cities* (1859),
Melville's *Moby-Dick* (1851), Carroll's *Alice's Adventures in Wonderland* (1865) and Conan
Doyle's *A Scandal in Bohemia* (1891), the Preamble and Article I, Section 1 of the U.S.
Constitution (1787) and the second paragraph of the Declaration of Independence (1776), all
public domain, and passages written for pdserve: a news-style report, a dialogue, a C function,
a recipe, a JSON record, a how-to, a Python test and an encyclopedia-style paragraph.
"""

from __future__ import annotations

EVAL_TEXTS: tuple[str, ...] = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the "
    "winter of despair, we had everything before us, we had nothing before us, we were all "
    "going direct to Heaven, we were all going direct the other way -- in short, the period was "
    "so far like the present period, that some of its noisiest authorities insisted on its "
    "being received, for good or for evil, in the superlative degree of comparison only.\n"
    "There were a king with a large jaw and a queen with a plain face, on the throne of "
    "England; there were a king with a large jaw and a queen with a fair face, on the throne of "
    "France. In both countries it was clearer than crystal to the lords of the State preserves "
    "of loaves and fishes, that things in general were settled for ever.\n",
    "Call me Ishmael. Some years ago -- never mind how long precisely -- having little or no "
    "money in my purse, and nothing particular to interest me on shore, I thought I would sail "
    "about a little and see the watery part of the world. It is a way I have of driving off the "
    "spleen and regulating the circulation. Whenever I find myself growing grim about the "
    "mouth; whenever it is a damp, drizzly November in my soul; whenever I find myself "
    "involuntarily pausing before coffin warehouses, and bringing up the rear of every funeral "
    "I meet; and especially whenever my hypos get such an upper hand of me, that it requires a "
    "strong moral principle to prevent me from deliberately stepping into the street, and "
    "methodically knocking people's hats off -- then, I account it high time to get to sea as "
    "soon as I can.\n",
    "We the People of the United States, in Order to form a more perfect Union, establish "
    "Justice, insure domestic Tranquility, provide for the common defence, promote the general "
    "Welfare, and secure the Blessings of Liberty to ourselves and our Posterity, do ordain and "
    "establish this Constitution for the United States of America.\nArticle I. Section 1. All "
    "legislative Powers herein granted shall be vested in a Congress of the United States, "
    "which shall consist of a Senate and House of Representatives.\n",
    "The city council voted on Tuesday to extend the tram line by 4.2 kilometres to the new "
    "hospital, ending a debate that has lasted almost three years. The extension, expected to "
    "cost 118 million euros, will add five stops and is due to open in the spring of 2027. "
    "Supporters said the line would cut the journey from the central station to the hospital "
    "from 35 minutes by bus to 14 minutes. Opponents questioned the ridership forecast of "
    "9,500 passengers a day and asked why the route avoids the western districts, where car "
    "ownership is lowest. The mayor promised a separate study of a western branch by the end "
    "of next year.\n",
    "\"Did you remember to water the tomatoes?\" Maria asked, setting down her bag.\n\"I did, "
    "twice,\" said Tom. \"The small ones by the fence are finally turning red.\"\n\"And the "
    "basil?\"\n\"Flowering again. I pinched the tops off, like you showed me.\"\nShe smiled and "
    "looked out at the garden. \"Then we'll have pesto on Sunday. Your mother is coming, isn't "
    "she?\"\n\"She said she'd bring the bread. And probably an opinion about the fence.\"\n",
    "#include <stddef.h>\n\n/* Binary search in a sorted array; returns the index or -1. */\n"
    "long find(const int *a, size_t n, int key) {\n    size_t lo = 0, hi = n;\n"
    "    while (lo < hi) {\n        size_t mid = lo + (hi - lo) / 2;\n"
    "        if (a[mid] < key) {\n            lo = mid + 1;\n        } else if (a[mid] > key) "
    "{\n            hi = mid;\n        } else {\n            return (long)mid;\n        }\n    }\n"
    "    return -1;\n}\n",
    "Lentil soup for four. Rinse 250 g of red lentils. Soften one chopped onion, two carrots and "
    "a stick of celery in two tablespoons of olive oil for about ten minutes. Add two cloves of "
    "garlic, a teaspoon of ground cumin and half a teaspoon of paprika, and stir for a minute. "
    "Add the lentils, a tin of chopped tomatoes and 1.2 litres of stock. Simmer for 25 minutes, "
    "until the lentils fall apart, then season with salt, pepper and the juice of half a "
    "lemon. Blend half of the soup for a thicker texture.\n",
    '{"id": 48213, "name": "Ada Lovelace", "born": "1815-12-10", "fields": ["mathematics", '
    '"computing"], "notes": "Wrote what is often called the first published algorithm for a '
    'machine, for Babbage\'s Analytical Engine, in 1843.", "works": [{"year": 1843, "title": '
    '"Sketch of the Analytical Engine, with notes"}], "active": false, "score": 9.75}\n',
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading, but it "
    "had no pictures or conversations in it, \"and what is the use of a book,\" thought Alice "
    "\"without pictures or conversations?\"\nSo she was considering in her own mind (as well as "
    "she could, for the hot day made her feel very sleepy and stupid), whether the pleasure of "
    "making a daisy-chain would be worth the trouble of getting up and picking the daisies, "
    "when suddenly a White Rabbit with pink eyes ran close by her.\nThere was nothing so very "
    "remarkable in that; nor did Alice think it so very much out of the way to hear the Rabbit "
    "say to itself, \"Oh dear! Oh dear! I shall be late!\"\n",
    "To Sherlock Holmes she is always the woman. I have seldom heard him mention her under any "
    "other name. In his eyes she eclipses and predominates the whole of her sex. It was not "
    "that he felt any emotion akin to love for Irene Adler. All emotions, and that one "
    "particularly, were abhorrent to his cold, precise but admirably balanced mind. He was, I "
    "take it, the most perfect reasoning and observing machine that the world has seen, but as "
    "a lover he would have placed himself in a false position.\n",
    "We hold these truths to be self-evident, that all men are created equal, that they are "
    "endowed by their Creator with certain unalienable Rights, that among these are Life, "
    "Liberty and the pursuit of Happiness. That to secure these rights, Governments are "
    "instituted among Men, deriving their just powers from the consent of the governed.\n",
    "How to replace a bicycle inner tube. First, shift to the smallest rear cog and open the "
    "brake's quick release. Remove the wheel and let out any remaining air. Push one tyre lever "
    "under the bead opposite the valve, hook it to a spoke, and run a second lever around the "
    "rim until one side of the tyre is free. Pull out the old tube and run your fingers slowly "
    "around the inside of the tyre to find the thorn or glass that caused the puncture. Inflate "
    "the new tube just enough to give it shape, insert the valve, tuck the tube in, and push the "
    "bead back over the rim with your thumbs, starting at the valve. Inflate to the pressure "
    "printed on the sidewall, usually between 4 and 7 bar for road tyres.\n",
    "import pytest\n\n\ndef slugify(title: str) -> str:\n"
    "    words = \"\".join(c if c.isalnum() else \" \" for c in title.lower()).split()\n"
    "    return \"-\".join(words)\n\n\n"
    "@pytest.mark.parametrize(\"title, expected\", [\n"
    "    (\"Hello, World!\", \"hello-world\"),\n    (\"  Many   spaces \", \"many-spaces\"),\n"
    "    (\"Version 2.0 released\", \"version-2-0-released\"),\n])\n"
    "def test_slugify(title, expected):\n    assert slugify(title) == expected\n",
    "The common swift (Apus apus) is a medium-sized bird that spends most of its life in the "
    "air. It feeds on insects caught in flight, drinks by skimming the surface of lakes, and "
    "can stay airborne for ten months at a time outside the breeding season. Adults are about "
    "17 centimetres long with a wingspan of 40 to 44 centimetres, and are almost entirely "
    "blackish brown apart from a pale throat. Swifts breed across Europe and Asia and winter in "
    "sub-Saharan Africa; they nest in cavities in buildings and cliffs, returning to the same "
    "site year after year.\n",
)
