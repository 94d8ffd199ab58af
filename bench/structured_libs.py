"""The grammar libraries compared for response_format, on SmolLM2's tokenizer (vocab 49152).

    pip install --target /tmp/solibs --no-deps llguidance xgrammar outlines-core apache-tvm-ffi
    for lib in llguidance xgrammar outlines_core; do
        PYTHONPATH=/tmp/solibs .venv/bin/python bench/structured_libs.py $lib
        PYTHONPATH=/tmp/solibs .venv/bin/python bench/structured_libs.py $lib --schema regex
    done

Prints one JSON object per run: `tokenizer_s` (the library's vocabulary tables, once per
engine), `compile_s` (one schema, cold), and the time to fill one request's token bitmask at
each token of a valid output (`fill_us_*`: mean, median, p90, max over its tokens). Schemas:
"typical" (nested object: bounded string, integer range, a pattern, an enum array, a sub-object,
a boolean) and "regex" (bounded repetitions in a pattern, an integer array). Compact JSON (no
whitespace) in every library. Only llguidance is a project dependency; the others are installed
aside for this comparison.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGUFReader  # noqa: E402

from engine.loader import default_model_path  # noqa: E402
from engine.loader.gguf_loader import read_metadata  # noqa: E402
from engine.tokenizer import TextTokenizer  # noqa: E402

SCHEMAS = {
    "typical": ({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city", "zip"], "additionalProperties": False},
            "active": {"type": "boolean"}},
        "required": ["name", "age", "email", "tags", "address", "active"], "additionalProperties": False,
    }, '{"name":"Ada Lovelace","age":36,"email":"ada@math.com","tags":["a","c"],'
       '"address":{"city":"London","zip":"W1"},"active":true}'),
    "regex": ({
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^[a-z]{1,200}[0-9]{1,200}$"},
                       "n": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 64}},
        "required": ["s", "n"], "additionalProperties": False,
    }, '{"s":"abc123","n":[1,2,3]}'),
}


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: vocabulary character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def run_llguidance(tok, schema, ids):
    import llguidance
    import llguidance.torch as lt

    t = time.perf_counter()
    llt = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_id)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}))
    assert not m.is_error(), m.get_error()
    compile_s = time.perf_counter() - t
    bm = lt.allocate_token_bitmask(1, tok.vocab_size)
    fills = []
    for tid in ids:
        t = time.perf_counter()
        lt.fill_next_token_bitmask(m, bm, 0)
        fills.append(time.perf_counter() - t)
        assert m.consume_token(tid), m.get_error()
    return setup, compile_s, fills, m.is_accepting()


def run_xgrammar(tok, schema, ids):
    import xgrammar as xgr

    t = time.perf_counter()
    enc = [""] * tok.vocab_size
    for s, i in tok.tokenizer.get_vocab(with_added_tokens=True).items():
        enc[i] = s
    info = xgr.TokenizerInfo(enc, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size,
                             stop_token_ids=[tok.eos_token_id])
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t
    m = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, tok.vocab_size)
    fills = []
    for tid in ids:
        t = time.perf_counter()
        m.fill_next_token_bitmask(bm, 0)
        fills.append(time.perf_counter() - t)
        assert m.accept_token(tid)
    return setup, compile_s, fills, m.accept_token(tok.eos_token_id)


def run_outlines_core(tok, schema, ids):
    import outlines_core as oc
    from outlines_core.kernels.torch import allocate_token_bitmask

    t = time.perf_counter()
    dec, special = byte_decoder(), set(tok.special_tokens)
    vocab: dict[bytes, list[int]] = {}
    for s, i in tok.tokenizer.get_vocab(with_added_tokens=True).items():
        if i != tok.eos_token_id:
            vocab.setdefault(s.encode() if s in special else bytes(dec[c] for c in s), []).append(i)
    voc = oc.Vocabulary(tok.eos_token_id, vocab)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    index = oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=""), voc)
    compile_s = time.perf_counter() - t
    g = oc.Guide(index)
    bm = allocate_token_bitmask(tok.vocab_size)
    fills = []
    for tid in ids:
        t = time.perf_counter()
        g.write_mask_into(bm.data_ptr(), bm.numel(), bm.element_size())
        fills.append(time.perf_counter() - t)
        g.advance(tid)
    return setup, compile_s, fills, g.is_finished()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib", choices=("llguidance", "xgrammar", "outlines_core"))
    ap.add_argument("--schema", choices=tuple(SCHEMAS), default="typical")
    args = ap.parse_args(argv)
    tok = TextTokenizer.from_gguf_metadata(read_metadata(GGUFReader(default_model_path())))
    schema, text = SCHEMAS[args.schema]
    ids = tok.encode(text, add_special_tokens=False)
    run = {"llguidance": run_llguidance, "xgrammar": run_xgrammar, "outlines_core": run_outlines_core}[args.lib]
    setup, compile_s, fills, accepted = run(tok, schema, ids)
    fills_sorted = sorted(fills)
    print(json.dumps({
        "lib": args.lib, "schema": args.schema, "vocab": tok.vocab_size, "tokens": len(ids), "accepted": accepted,
        "tokenizer_s": round(setup, 3), "compile_s": round(compile_s, 4),
        "fill_us_mean": round(sum(fills) / len(fills) * 1e6, 1),
        "fill_us_median": round(fills_sorted[len(fills) // 2] * 1e6, 1),
        "fill_us_p90": round(fills_sorted[int(len(fills) * 0.9)] * 1e6, 1),
        "fill_us_max": round(fills_sorted[-1] * 1e6, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
