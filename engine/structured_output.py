"""Structured output: a request's `response_format` becomes a grammar over the engine's vocabulary,
and each step masks the logits rows of constrained requests to the tokens their grammar allows.

Library: llguidance (bench/RESULTS.md, "Structured output", says why), imported lazily: an engine
without it serves everything else and refuses a request with a response_format (400, naming
`response_format`).

Contracts:
- `compile` turns a validated response_format (SamplingParams.response_format) into a `Grammar`.
  It may take milliseconds (the tokenizer's tables, once per engine, take a fraction of a second),
  so it runs off the step thread: AsyncLLMEngine.generate calls it on a worker thread and passes
  the result in GenerationRequest.grammar. Compiled grammars are kept in an LRU cache keyed by the
  canonical JSON of the schema (at most `cache_size` of them: bounded memory).
- What the library cannot compile, or cannot serve, is InvalidRequestError naming
  `response_format` (`tools` for a tool-call grammar), with the library's reason. "Cannot serve"
  is found by a probe in `compile`: PROBE_TOKENS steps along one path (forced tokens, then the
  lowest allowed token each time), where a recursive `$ref` with no finite value, a row past the
  library's item limit (an object of hundreds of optional properties) or a regex past its lexer
  limits fails. The gateway compiles before admission with the same code, so such a request is
  refused before any quota is held (tessera.api.completions_request.check_grammar).
- Every limit is the library's own, per request (LLParserLimits, GRAMMAR_LIMITS): compile fuel and
  grammar size bound `compile`; per-step lexer fuel and Earley items bound each mask, so one
  tenant's grammar cannot stall the step for the others. The schema's size and depth are bounded
  before it gets here (SamplingParams).
- A grammar that fails later, on a path the probe did not take, fails only its request, as the
  client's error: GrammarRejected carries the parameter to name (the engine finishes the request
  with `RequestOutput.invalid_param`; never an engine fault).
- Per request, `start` makes a matcher (a copy of the compiled grammar's pristine one), `constrain`
  masks the batch's constrained rows (a copy of the logits: the raw rows stay raw for whoever
  reads them), `accept` advances a matcher by the sampled token and says whether the grammar is
  complete, `release` drops it. All of these run on the step thread.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.sampling_params import InvalidRequestError

#: Compiled grammars kept per engine.
DEFAULT_CACHE_SIZE = 256
#: llguidance's JSON options for every schema compiled here (and for the schemas a Lark grammar
#: embeds, as their "x-guidance"): compact JSON, since flexible whitespace would let a model emit
#: blank lines until max_tokens; a schema's own x-guidance options cannot turn that back on.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: The longest library message passed on to a client (its parser state is not the client's concern).
_MAX_REASON_CHARS = 300
#: The library's per-request limits, stated here (they are its defaults) so the gateway and every
#: engine apply the same ones: grammar symbols and initial lexer fuel bound compiling; per mask,
#: lexer fuel (~14k/ms) and Earley items (~20k/ms) bound a step's work; a row's items and the
#: lexer's states bound memory. Errors never carry the grammar's text (verbose_errors off).
GRAMMAR_LIMITS = {"max_items_in_row": 2000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
                  "step_max_items": 50_000, "max_lexer_states": 250_000, "max_grammar_size": 500_000}
#: Steps of `compile`'s probe: most grammars that cannot be served fail within their first few
#: tokens; a step's mask costs about a millisecond, once per distinct schema (then cached).
PROBE_TOKENS = 8


#: Row b: the additive bias of the 8 tokens whose bits byte value b holds (0: allowed, -inf: not).
_BYTE_BIAS = torch.tensor([[0.0 if (b >> i) & 1 else float("-inf") for i in range(8)] for b in range(256)])


class GrammarRejected(RuntimeError):
    """A request's matcher refused a token or failed to compute its mask (the request fails, as
    the client's error: `param` is the request field whose grammar it is)."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Grammar:
    """A compiled response_format: `key` is its schema's canonical JSON; `template` the library's matcher
    in its start state, copied for each request (never advanced itself)."""

    key: str
    template: object
    #: The request field the grammar came from: "response_format", or "tools" (a Lark grammar
    #: built from the tools' schemas).
    param: str = "response_format"


def _library():
    try:
        import llguidance
    except ImportError:
        raise InvalidRequestError(
            "response_format is not supported by this engine (the llguidance package is not installed)",
            "response_format") from None
    return llguidance


def schema_of(response_format: dict) -> dict:
    """The JSON schema a validated response_format constrains the output to: any JSON object for
    json_object (and for a json_schema without a schema), else the given schema."""
    if response_format["type"] == "json_schema":
        return response_format["json_schema"].get("schema") or {"type": "object"}
    return {"type": "object"}


class StructuredOutput:
    """The engine's grammars: the compile cache (thread-safe) and the matchers of its requests."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, *, cache_size: int = DEFAULT_CACHE_SIZE):
        """`tokenizer`: the engine's TextTokenizer; `vocab_size`: the logits' width (tokens the
        tokenizer does not have are never allowed); `eos_token_ids`: the tokens that end a
        completion, allowed once the grammar is complete. Nothing is imported or built yet."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._matchers: dict[str, object] = {}
        self._params: dict[str, str] = {}  # request id -> its grammar's Grammar.param
        # [max rows, words] int32, grown on demand; reused every step (step thread only).
        self._bitmask: torch.Tensor | None = None
        # CPU fp32 logits: the bias rows and the masked logits, reused every step (step thread
        # only; what `constrain` returns is valid until its next call).
        self._bias: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._bits = torch.arange(32, dtype=torch.int32)

    # -- compiling (any thread) -----------------------------------------------------------------

    def compile(self, response_format: dict) -> Grammar:
        """The grammar of a validated response_format (SamplingParams.response_format), from the
        cache or compiled now. Raises InvalidRequestError naming `response_format` (`tools` for a
        tool-call grammar) when the library is missing or cannot compile it."""
        if response_format["type"] == "lark":
            schema, key = None, "lark:" + response_format["lark"]
        else:
            schema = schema_of(response_format)
            # The schema alone decides the grammar (not its name or description).
            key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        ll = _library()
        tokenizer = self._llguidance_tokenizer(ll)
        try:
            if schema is None:
                text = ll.LLMatcher.grammar_from_lark(response_format["lark"])
            else:
                text = ll.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT_JSON)
            template = ll.LLMatcher(tokenizer, text, log_level=0,
                                    limits=ll.LLParserLimits(**GRAMMAR_LIMITS, verbose_errors=False))
        except Exception as e:  # noqa: BLE001 - whatever the library says about a schema is the client's 400
            raise _uncompilable(schema, str(e)) from None
        if template.is_error():
            raise _uncompilable(schema, template.get_error())
        reason = self._probe(template)
        if reason is not None:
            raise _uncompilable(schema, reason, served=True)
        grammar = Grammar(key, template, "tools" if schema is None else "response_format")
        with self._lock:
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _probe(self, template) -> str | None:
        """Why the grammar cannot be served, found within its first PROBE_TOKENS steps along one
        path (each step: the forced tokens, if any, then the lowest allowed token id, EOS aside),
        or None. Runs on a copy."""
        m = template.deep_copy()
        eos = set(self._eos)
        for _ in range(PROBE_TOKENS):
            # Tokens every output must continue with (a tool call's fixed opening) take one step.
            forced = m.compute_ff_tokens()
            if (forced and not m.consume_tokens(forced)) or m.is_error():
                return m.get_error()
            mask = m.compute_bitmask()
            if m.is_error():
                return m.get_error()
            if m.is_stopped() or m.is_accepting():
                return None
            token = _lowest_token(mask, self.vocab_size, eos)
            if token is None:
                return "the grammar allows no token"
            if not m.consume_token(token):
                return m.get_error()
        return None

    def cached(self) -> int:
        """How many compiled grammars the cache holds."""
        with self._lock:
            return len(self._cache)

    def _llguidance_tokenizer(self, ll):
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll.LLTokenizer(self._tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                    eos_token=self._eos)
            return self._ll_tokenizer

    # -- requests (the step thread) --------------------------------------------------------------

    def start(self, request_id: str, grammar: Grammar) -> None:
        """Constrain `request_id`'s completion to `grammar` from its first token."""
        self._matchers[request_id] = grammar.template.deep_copy()
        self._params[request_id] = grammar.param

    def release(self, request_id: str) -> None:
        """Forget `request_id`'s matcher (it finished or was dropped); a no-op if it has none."""
        self._matchers.pop(request_id, None)
        self._params.pop(request_id, None)

    def clear(self) -> None:
        """Forget every request's matcher (the engine was reset); the compile cache stays."""
        self._matchers.clear()
        self._params.clear()

    def constrains(self, request_id: str) -> bool:
        """Whether `request_id`'s completion is constrained (it has a matcher)."""
        return request_id in self._matchers

    @property
    def active(self) -> bool:
        """Whether any request in the engine is constrained."""
        return bool(self._matchers)

    def constrain(self, logits: torch.Tensor, request_ids: list[str]) -> tuple[torch.Tensor, dict[int, Exception]]:
        """logits: [N, V] with row i for request_ids[i] -> (logits whose constrained rows allow
        only their grammar's next tokens, failures). The input is never written: with any
        constrained row the result is a copy (on CPU, a buffer reused by the next call: use it
        before then). `failures` maps the rows whose matcher could not
        compute a mask (or allows nothing) to a GrammarRejected; those rows are left unmasked
        and their requests must fail."""
        if not self._matchers:
            return logits, {}
        rows = [(i, m) for i, rid in enumerate(request_ids) if (m := self._matchers.get(rid)) is not None]
        if not rows:
            return logits, {}
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            self._bitmask = torch.zeros(max(len(rows), 8), words, dtype=torch.int32)
        bitmask = self._bitmask[:len(rows)]
        failures: dict[int, Exception] = {}
        ok: list[int] = []
        for j, (i, m) in enumerate(rows):
            row = self._bitmask[j]
            m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            param = self._params.get(request_ids[i], "response_format")
            if m.is_error():
                failures[i] = GrammarRejected(f"{_subject(param)} failed: {_reason(m.get_error())}", param)
            elif not bool(bitmask[j].any()):
                failures[i] = GrammarRejected(f"{_subject(param)} allows no further token", param)
            else:
                ok.append(j)
        if not ok:
            return logits, failures
        mask = bitmask[ok] if len(ok) < len(rows) else bitmask
        n, vocab = logits.shape
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # Bit i of byte k allows token 8k + i (llguidance writes 32-bit words, bit b of word w
            # for token 32w + b, in the host's little-endian order). A table row per byte value
            # turns the mask into an additive bias (0 or -inf) with one gather, far cheaper on
            # CPU than an elementwise select over the vocabulary. Both results go to buffers kept
            # across steps: fresh multi-megabyte tensors each step would cost page faults.
            if self._bias is None or self._bias.shape[0] < len(ok) or self._out.shape[0] < n:
                self._bias = torch.empty(max(len(ok), n, 8), words * 32)
                self._out = torch.empty(max(len(ok), n, 8), words * 32)
            bias = self._bias[:len(ok)]
            torch.index_select(_BYTE_BIAS, 0, mask.view(torch.uint8).reshape(-1).int(), out=bias.view(-1, 8))
            bias = bias[:, :vocab]
            out = self._out[:n, :vocab]
            out.copy_(logits)
        else:
            # The small bitmask crosses to the device; the expansion runs there.
            on_device = mask.to(logits.device, non_blocking=True)
            allowed = ((on_device.unsqueeze(-1) >> self._bits.to(logits.device)) & 1).view(len(ok), -1)
            bias = torch.zeros((), dtype=logits.dtype, device=logits.device).expand(len(ok), vocab)
            bias = bias.masked_fill(allowed[:, :vocab] == 0, float("-inf"))
            out = logits.clone()
        if len(ok) == n:
            out.add_(bias)
        else:
            for k, j in enumerate(ok):
                out[rows[j][0]].add_(bias[k])
        return out, failures

    def accept(self, request_id: str, token: int) -> bool:
        """Advance `request_id`'s matcher by the sampled `token`: True when its grammar is now
        complete (the completion must stop), False when it goes on or the request is not
        constrained. Raises GrammarRejected when the grammar does not allow `token`."""
        m = self._matchers.get(request_id)
        if m is None:
            return False
        if not m.consume_token(token):
            param = self._params.get(request_id, "response_format")
            raise GrammarRejected(f"{_subject(param)} rejected token {token}: {_reason(m.get_error())}", param)
        return m.is_stopped()


def _uncompilable(schema: dict | None, reason: str, *, served: bool = False) -> InvalidRequestError:
    """The 400 for a grammar the library refused (`served`: compiled, but failed the probe): a
    response_format's schema, or (schema None) the tool-call grammar built from the request's tools."""
    verb = "served" if served else "compiled"
    if schema is None:
        return InvalidRequestError(f"tools: the tools' parameters cannot be {verb}: {_reason(reason)}", "tools")
    return InvalidRequestError(f"response_format: the schema cannot be {verb}: {_reason(reason)}", "response_format")


def _subject(param: str) -> str:
    return "the tools' call grammar" if param == "tools" else "the response_format grammar"


def _lowest_token(mask: bytes, vocab_size: int, eos: set[int]) -> int | None:
    """The lowest token id below `vocab_size` whose bit is set in `mask` (llguidance's layout:
    bit b of byte k allows token 8k + b), EOS aside; None if there is none."""
    start = 0
    while True:
        nonzero = len(mask) - len(mask[start:].lstrip(b"\0"))
        if nonzero >= len(mask):
            return None
        byte = mask[nonzero]
        for bit in range(8):
            token = 8 * nonzero + bit
            if byte >> bit & 1 and token < vocab_size and token not in eos:
                return token
        start = nonzero + 1


def _reason(reason: str) -> str:
    """The library's message for a client: the first line, bounded, and its stop reasons for a
    grammar that can produce nothing said in words."""
    line = _short(reason)
    if line.startswith("NoExtension"):
        return "the grammar allows no output (a schema with no finite value, such as a $ref to itself)"
    return line


def _short(reason: str) -> str:
    """The first line of a library message, bounded in length."""
    line = reason.strip().splitlines()[0] if reason.strip() else "unknown reason"
    return line if len(line) <= _MAX_REASON_CHARS else line[:_MAX_REASON_CHARS] + "..."
