"""Real data for the framework examples, from Debian packages, nothing
downloaded at run time:

- English text: the ``fortunes`` collection (``apt-get install fortunes``,
  or ``make deps-text``), split into its fortunes;
- images: Fashion-MNIST as ``dataset-fashion-mnist`` ships it (``make
  deps-images``), 28x28 grey pictures of clothes in 10 classes.

The BERT example needs a tokenizer, and a pretrained one would be a
download: ``write_vocab`` builds a WordPiece vocabulary from the text
itself (its most frequent words, and every character alone and as a
word's continuation, so that no word is unknown) for ``BertTokenizer``.
"""

import collections
import gzip
import os
import re

import numpy as np

FORTUNES = "/usr/share/games/fortunes"
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
# Pictures drawn in characters, not text.
NOT_TEXT = ("art", "ascii-art")
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def fortunes(folder=FORTUNES):
    """Every fortune of the collection's text files, in file-name order, as
    a list of strings. FileNotFoundError naming the package when missing."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder} is missing: install Debian's fortunes package (make deps-text)")
    names = sorted(n for n in os.listdir(folder) if "." not in n and n not in NOT_TEXT)
    entries = []
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            text = f.read().decode("utf-8", "replace")
        entries += [" ".join(e.split()) for e in text.split("\n%\n") if e.strip()]
    return entries


def write_vocab(texts, folder, words=2000):
    """Write ``folder``/vocab.txt: BERT's special tokens, the ``words`` most
    frequent lower-cased words of ``texts``, then every character seen,
    alone and as ``##c``. Returns the file's path."""
    counts = collections.Counter()
    chars = set()
    for t in texts:
        t = t.lower()
        chars.update(c for c in t if not c.isspace())
        counts.update(re.findall(r"\w+|[^\w\s]", t))
    vocab = list(SPECIAL)
    vocab += [w for w, _ in counts.most_common(words) if w not in SPECIAL]
    seen = set(vocab)
    for c in sorted(chars):
        for piece in (c, "##" + c):
            if piece not in seen:
                seen.add(piece)
                vocab.append(piece)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")
    return path


def fashion_mnist(split="train", folder=FASHION_MNIST):
    """(images, labels) of Fashion-MNIST's own ``split`` ("train": 60,000,
    "t10k": 10,000) as uint8 N x 28 x 28 and int64 N numpy arrays."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder} is missing: install Debian's dataset-fashion-mnist package (make deps-images)")

    def idx(name, offset):  # an IDX file's payload, past its header of `offset` bytes
        with gzip.open(os.path.join(folder, name), "rb") as f:
            return np.frombuffer(f.read()[offset:], dtype=np.uint8)

    labels = idx(f"{split}-labels-idx1-ubyte.gz", 8).astype(np.int64)
    return idx(f"{split}-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28), labels
