#!/usr/bin/env python3
"""A labelled set of paraphrase / non-paraphrase sentence pairs built from Princeton WordNet 3.0
(Debian package `wordnet-base`: /usr/share/wordnet/data.{noun,verb,adj,adv}), for
bench/semantic_cache_bench.cpp.

No corpus of human-labelled paraphrases (MRPC, PAWS, STS-B, Quora) ships in a Debian or PyPI
package reachable here, so the pairs are derived, by fixed rules, from WordNet's example
sentences (the quoted parts of each synset's gloss):

  label 1 (paraphrase)      an example sentence containing lemma w of a synset, and the same
                            sentence with w replaced by another lemma of that synset (a synonym
                            in that sense): "the team was able to win" / "the team was capable
                            to win" ... the meaning is kept, the words change;
  label 0 (antonym)         the example with w replaced by a WordNet antonym of w ("!" pointer):
                            almost the same words, the opposite meaning (PAWS-style hard negatives);
  label 0 (other example)   two different example sentences of the same synset: one topic and
                            sense, different requests ("able to swim" / "able to buy a car").

Output: TSV `label<TAB>kind<TAB>sentence1<TAB>sentence2`, deterministic (seeded sample).

    python3 bench/make_paraphrase_pairs.py -n 1000 > /tmp/pairs.tsv
"""
import argparse
import random
import re
import sys

POS_FILES = {"n": "noun", "v": "verb", "a": "adj", "s": "adj", "r": "adv"}


def read_synsets(root):
    synsets = {}
    for name in ("noun", "verb", "adj", "adv"):
        with open(f"{root}/data.{name}", encoding="latin-1") as f:
            for line in f:
                if line.startswith("  "):
                    continue  # the license header
                head, _, gloss = line.partition(" | ")
                fields = head.split()
                offset, pos = fields[0], fields[2]
                n_words = int(fields[3], 16)
                words = [fields[4 + 2 * i].replace("_", " ") for i in range(n_words)]
                words = [re.sub(r"\(.*\)$", "", w) for w in words]  # adjective markers: "able(p)"
                k = 4 + 2 * n_words
                n_ptrs = int(fields[k])
                antonyms = []  # (source word index, target synset key, target word index)
                for i in range(n_ptrs):
                    sym, target, tpos, st = fields[k + 1 + 4 * i: k + 5 + 4 * i]
                    if sym == "!":
                        antonyms.append((int(st[:2], 16) - 1, (target, tpos if tpos != "s" else "a"), int(st[2:], 16) - 1))
                examples = re.findall(r'"([^"]{12,200})"', gloss)
                synsets[(offset, "a" if pos == "s" else pos)] = {"words": words, "antonyms": antonyms,
                                                                "examples": examples}
    return synsets


def replace_word(sentence, word, new):
    pattern = re.compile(r"\b" + re.escape(word) + r"\b")
    if not pattern.search(sentence) or word == new:
        return None
    return pattern.sub(new, sentence, count=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=1000, help="pairs in all (half paraphrases)")
    ap.add_argument("--wordnet", default="/usr/share/wordnet")
    ap.add_argument("--seed", type=int, default=15)
    args = ap.parse_args()
    synsets = read_synsets(args.wordnet)
    para, anto, other = [], [], []
    for key, s in synsets.items():
        words, examples = s["words"], s["examples"]
        for ex in examples:
            for i, w in enumerate(words):
                if len(w) < 3:
                    continue
                for j, w2 in enumerate(words):
                    if j != i and w2.lower() != w.lower():
                        new = replace_word(ex, w, w2)
                        if new:
                            para.append((1, "synonym", ex, new))
                            break
                for src, target, dst in s["antonyms"]:
                    if src == i and target in synsets and dst < len(synsets[target]["words"]):
                        new = replace_word(ex, w, synsets[target]["words"][dst])
                        if new:
                            anto.append((0, "antonym", ex, new))
        if len(examples) >= 2:
            other.append((0, "other-example", examples[0], examples[1]))
    rng = random.Random(args.seed)
    half = args.n // 2
    picked = rng.sample(para, half)
    n_anto = min(len(anto), (args.n - half) // 2)
    picked += rng.sample(anto, n_anto) + rng.sample(other, args.n - half - n_anto)
    rng.shuffle(picked)
    print(f"# {len(para)} synonym, {len(anto)} antonym, {len(other)} other-example candidates; "
          f"picked {len(picked)} (seed {args.seed}) from WordNet 3.0", file=sys.stderr)
    for label, kind, a, b in picked:
        print(f"{label}\t{kind}\t{a}\t{b}")


if __name__ == "__main__":
    main()
