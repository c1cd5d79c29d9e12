"""Shared pieces of tests/test_integrations.py: a tiny word-level tokenizer (no download), random
text / prompt-completion / chat / preference data, and spies that record what ran."""

import random

WORDS = [f"w{i}" for i in range(4, 128)]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
# A chat template with {% generation %} markers, for TRL's assistant_only_loss.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<s> {{ m['content'] }} "
    "{% else %}{% generation %}{{ m['content'] }} </s> {% endgeneration %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{% endif %}"
)


def make_tokenizer():
    """A 128-token word-level tokenizer matching the tiny configs' vocab_size=128 (pad id 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def words(rng, low, high):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def text_rows(n, seed, low=10, high=30):
    rng = random.Random(seed)
    return {"text": [words(rng, low, high) for _ in range(n)]}


def prompt_completion_rows(n, seed):
    rng = random.Random(seed)
    return {"prompt": [words(rng, 4, 12) for _ in range(n)], "completion": [words(rng, 6, 16) for _ in range(n)]}


def chat_rows(n, seed):
    rng = random.Random(seed)
    return {
        "messages": [
            [
                {"role": "user", "content": words(rng, 3, 8)},
                {"role": "assistant", "content": words(rng, 3, 8)},
                {"role": "user", "content": words(rng, 3, 8)},
                {"role": "assistant", "content": words(rng, 3, 8)},
            ]
            for _ in range(n)
        ]
    }


def preference_rows(n, seed):
    rng = random.Random(seed)
    return {
        "prompt": [words(rng, 4, 10) for _ in range(n)],
        "chosen": [words(rng, 5, 14) for _ in range(n)],
        "rejected": [words(rng, 5, 14) for _ in range(n)],
    }
