"""Held-out text for ``python -m pdserve.bench.kv_int8`` (none of it is calibration text).

Passages of different kinds: the openings of Dickens' *A Tale of Two Cities* (1859) and
Melville's *Moby-Dick* (1851), the Preamble and Article I, Section 1 of the U.S. Constitution
(1787), all public domain, and passages written for pdserve: a news-style report, a dialogue,
a C function, a recipe and a JSON record.
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
)
