"""Tokenizer from GGUF metadata against HF's, chat template, incremental detokenization."""
from engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines",
    "Numbers 1234567 and 3.14159",
    "Unicode: café, naïve, Ωmega, 日本語, 🎉🚀",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # square",
]


def test_encode_matches_transformers(tokenizer, hf_tokenizer):
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=True), text


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    convs = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Tell me a joke"}],
    ]
    for msgs in convs:
        ours = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        theirs = hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert ours == theirs


def test_incremental_detokenizer_never_emits_broken_utf8(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        d = IncrementalDetokenizer(tokenizer)
        deltas = [d.push(i) for i in ids]
        assert all("\ufffd" not in x for x in deltas)
        assert "".join(deltas) == tokenizer.decode(ids)
