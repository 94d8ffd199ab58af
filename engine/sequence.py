"""Request state inside the engine."""
from __future__ import annotations

import enum
import itertools
import random
import time

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import Priority, SamplingParams

_seq_ids = itertools.count()
_MASK64 = (1 << 64) - 1


def generator_seed(seed: int | None) -> int:
    """The torch.Generator seed of a request with `seed` (SamplingParams' signed 64-bit range).

    The CPU generator (mt19937) keeps only the low 32 bits of its seed, so seeds that differ only
    in their high bits or sign (0, 2**32, -2**63) would give the same tokens: seeds in [0, 2**32)
    are used as they are, others are mixed into 32 bits by splitmix64's finalizer, so every bit
    counts. No seed: 32 random bits."""
    if seed is None:
        return random.getrandbits(32)
    if 0 <= seed < 1 << 32:
        return seed
    z = seed & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFF_FFFF


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens, KV blocks and output state of one request.

    The KV of tokens [0, num_computed_tokens) is in the cache (block_table). A step computes the
    next tokens [num_computed_tokens, num_computed_tokens + n); when that reaches num_tokens the
    step's logits for the last token are sampled and the new token appended.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, *, tenant_id: str = "default",
                 priority: Priority = Priority.standard, adapter: str | None = None,
                 cache_salt: str | None = None, device: torch.device | str = "cpu"):
        """`device`: where the engine samples (a non-greedy request's generator lives there).
        `cache_salt`: the prefix-cache scope (engine.block_manager)."""
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.tenant_id = tenant_id
        self.priority = priority
        self.adapter = adapter
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt + output, appended in place
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.cache_salt = cache_salt
        #: Chained content hashes of the full blocks of token_ids computed so far (the block
        #: manager extends it lazily), and how many leading blocks of block_table it has offered
        #: to the prefix cache.
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        #: Prompt tokens served from the prefix cache when first scheduled; None before that.
        self.num_cached_tokens: int | None = None
        self.status = SequenceStatus.WAITING
        self.arrival_time = time.monotonic()
        #: When the scheduler first gave it a seat (time.monotonic()); None while it never had one.
        self.first_scheduled_time: float | None = None
        self.detokenizer = detokenizer
        self.output_text = ""
        self.emitted_text_len = 0
        self.emitted_token_len = 0
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(generator_seed(params.seed))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """After preemption: the KV is gone; prompt + output so far will be prefilled again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_committed_blocks = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
