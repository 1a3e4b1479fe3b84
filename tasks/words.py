"""Word pools for the procedural tasks (counting, sorting, reversing, word problems).

Short, common, concrete nouns, each a single token-ish lowercase ASCII word, so tiny models can read
and copy them. No function words ("the", "is", "answer"): a list answer given in a sentence is read
by keeping only the item's own words, which must never collide with the words around them.
"""

from __future__ import annotations

WORDS: tuple[str, ...] = (
    "ant", "apple", "arm", "baby", "bag", "ball", "band", "bank", "bean", "bear", "bed", "bee",
    "bell", "bird", "boat", "bone", "book", "boot", "bowl", "box", "bread", "brick", "bus", "cake",
    "car", "card", "cat", "chair", "clock", "cloud", "coat", "coin", "corn", "cow", "crab", "cup",
    "desk", "dog", "doll", "door", "duck", "egg", "eye", "farm", "fish", "flag", "fork", "fox",
    "frog", "game", "gate", "girl", "goat", "hat", "hill", "horse", "house", "jam", "key", "kite",
    "lamp", "leaf", "lion", "map", "milk", "moon", "mouse", "nest", "nose", "owl", "pan", "pen",
    "pig", "pipe", "plant", "plate", "pond", "queen", "rain", "ring", "road", "rock", "rose",
    "sand", "seed", "sheep", "ship", "shoe", "sock", "spoon", "star", "stone", "sun", "table",
    "tent", "tiger", "toy", "train", "tree", "truck", "van", "vase", "wall", "whale", "wheel",
    "wolf", "yarn", "zebra",
)

NAMES: tuple[str, ...] = (
    "Maria", "Tom", "Aisha", "Ben", "Chen", "Lena", "Omar", "Priya", "Sam", "Yuki", "Carlos",
    "Nora", "Ivan", "Zara", "Leo", "Mia",
)

# (singular, plural) goods with a price, for shopping and price-system word problems.
GOODS: tuple[tuple[str, str], ...] = (
    ("apple", "apples"), ("pear", "pears"), ("lemon", "lemons"), ("mango", "mangoes"),
    ("pencil", "pencils"), ("notebook", "notebooks"), ("candle", "candles"), ("cookie", "cookies"),
    ("marble", "marbles"), ("sticker", "stickers"), ("cupcake", "cupcakes"), ("balloon", "balloons"),
)

assert len(set(WORDS)) == len(WORDS) and all(w.isascii() and w.isalpha() and w.islower() for w in WORDS)
