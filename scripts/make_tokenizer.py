#!/usr/bin/env python3
"""Train a tiny byte-level BPE tokenizer for guidellm, fully offline.

guidellm needs a Hugging Face tokenizer to size synthetic prompts. Instead of
downloading one, this trains a 512-token byte-level BPE on English-like text
generated here from a fixed word list and a fixed seed, so the output is the
same on every machine. Only the `tokenizers` package is needed (a dependency
of guidellm via transformers).

Usage: make_tokenizer.py OUT_DIR
Writes OUT_DIR/tokenizer.json and OUT_DIR/tokenizer_config.json (loadable by
transformers' AutoTokenizer as a PreTrainedTokenizerFast).
"""

import json
import os
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SEED = 20240601
SENTENCES = 4000
VOCAB_SIZE = 512
SPECIAL = "<|endoftext|>"

WORDS = """
the of and to a in is it you that he was for on are with as his they be at one
have this from or had by hot word but what some we can out other were all there
when up use your how said an each she which do their time if will way about many
then them write would like so these her long make thing see him two has look more
day could go come did number sound no most people my over know water than call
first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under
name very through just form sentence great think say help low line differ turn cause
much mean before move right boy old too same tell does set three want air well also
play small end put home read hand port large spell add even land here must big high
such follow act why ask men change went light kind off need house picture try us
again animal point mother world near build self earth father head stand own page
should country found answer school grow study still learn plant cover food sun four
between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north
open seem together next white children begin got walk example ease paper group
always music those both mark often letter until mile river car feet care second book
carry took science eat room friend began idea fish mountain stop once base hear horse
cut sure watch color face wood main enough plain girl usual young ready above ever
red list though feel talk bird soon body dog family direct pose leave song measure
door product black short numeral class wind question happen complete ship area half
rock order fire south problem piece told knew pass since top whole king space heard
best hour better true during hundred five remember step early hold west ground
interest reach fast verb sing listen six table travel less morning ten simple several
vowel toward war lay against pattern slow center love person money serve appear road
map rain rule govern pull cold notice voice unit power town fine certain fly fall lead
cry dark machine note wait plan figure star box noun field rest correct able pound
done beauty drive stood contain front teach week final gave green oh quick develop
ocean warm free minute strong special mind behind clear tail produce fact street inch
multiply nothing course stay wheel full force blue object decide surface deep moon
island foot system busy test record boat common gold possible plane stead dry wonder
laugh thousand ago ran check game shape equate miss brought heat snow tire bring yes
distant fill east paint language among
""".split()


def corpus(rng: random.Random):
    """Yield seeded English-like lines: sentences, numbers, punctuation, cases."""
    for i in range(SENTENCES):
        n = rng.randint(4, 18)
        words = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 9999)))
        if rng.random() < 0.2:
            j = rng.randrange(len(words))
            words[j] = words[j] + ","
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".....?!")
        if i % 7 == 0:
            sentence = sentence + "\n"
        yield sentence


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: make_tokenizer.py OUT_DIR", file=sys.stderr)
        return 2
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus(random.Random(SEED))), trainer=trainer)
    tok.save(os.path.join(out, "tokenizer.json"))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        "bos_token": SPECIAL,
        "eos_token": SPECIAL,
        "unk_token": SPECIAL,
        "pad_token": SPECIAL,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    print(f"tokenizer: {out} (vocab {tok.get_vocab_size()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
