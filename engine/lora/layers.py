"""Device slots for adapters (the step's LoRA batch that reads them is the backend's:
engine.backends.base.LoRABatch).

The slot stacks hold, per (layer, fused group), one zero-padded A and B stack per slice:
    qkv:     A q/k/v [S, R, hidden]      B q [S, q, R], k/v [S, kv, R]
    o:       A [S, R, q]                 B [S, hidden, R]
    gate_up: A gate/up [S, R, hidden]    B gate/up [S, inter, R]
    down:    A [S, R, inter]             B [S, hidden, R]
A module an adapter does not target stays zero in its slot. Each (layer, group) stack has its own
per-slot rank and scale, rows of `ranks` [L * G, S] and `scales` [L * G, S] (row
`row_of[(layer, group)]`, the stack's `LoRAStack.ranks` / `.scales` views): a slot's
rank there is its adapter's largest rank among the group's modules in that layer (0 where it
targets none), so punica_kernels does work proportional to it, not to R nor to the adapter's
largest rank elsewhere. A module of smaller rank than its group's is zero-padded to it, and its
B carries its scale relative to the group's (LoRAWeights.group_scale). int8 slots also hold each row's fp32
scale: `a_rs[(layer, module)]` [S, R] and `b_rs[(layer, module)]` [S, out] (the adapters arrive
quantized: LoRAWeights.quantized).
"""
from __future__ import annotations

import torch

import punica_kernels
from engine.config import ModelConfig
from engine.lora.weights import GROUPS, LoRAWeights

__all__ = ["GROUPS", "LoRASlots"]


class LoRASlots:
    """`num_slots` adapter slots of rank <= `max_rank` for every layer (the device tier)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype, device="cpu"):
        self.num_slots = num_slots
        self.max_rank = max_rank
        dims = {
            "q": (cfg.hidden_size, cfg.q_size), "k": (cfg.hidden_size, cfg.kv_size),
            "v": (cfg.hidden_size, cfg.kv_size), "o": (cfg.q_size, cfg.hidden_size),
            "gate": (cfg.hidden_size, cfg.intermediate_size), "up": (cfg.hidden_size, cfg.intermediate_size),
            "down": (cfg.intermediate_size, cfg.hidden_size),
        }
        S, R = num_slots, max_rank
        self.device = torch.device(device)
        self.quantized = dtype == torch.int8
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.a_rs: dict[tuple[int, str], torch.Tensor] = {}
        self.b_rs: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(cfg.num_layers):
            for m, (fan_in, fan_out) in dims.items():
                self.a[(layer, m)] = torch.zeros(S, R, fan_in, dtype=dtype, device=device)
                self.b[(layer, m)] = torch.zeros(S, fan_out, R, dtype=dtype, device=device)
                if self.quantized:
                    self.a_rs[(layer, m)] = torch.zeros(S, R, dtype=torch.float32, device=device)
                    self.b_rs[(layer, m)] = torch.zeros(S, fan_out, dtype=torch.float32, device=device)
        keys_in_order = [(layer, group) for layer in range(cfg.num_layers) for group in GROUPS]
        self.row_of: dict[tuple[int, str], int] = {k: i for i, k in enumerate(keys_in_order)}
        self.ranks = torch.zeros(len(keys_in_order), S, dtype=torch.int32, device=device)
        self.scales = torch.zeros(len(keys_in_order), S, dtype=torch.float32, device=device)
        self.num_layers = cfg.num_layers
        self.offsets = {"qkv": [0, cfg.q_size, cfg.q_size + cfg.kv_size], "gate_up": [0, cfg.intermediate_size]}
        # Each (layer, group)'s stacks checked once for punica_kernels.add_lora: a decode step makes
        # 4 calls a layer, and the stacks do not change between calls, so only the activations
        # are checked per call.
        self.stacks: dict[tuple[int, str], punica_kernels.LoRAStack] = {}
        for layer in range(cfg.num_layers):
            for group, mods in GROUPS.items():
                keys = [(layer, m) for m in mods]
                ranks, scales = self.ranks[self.row_of[(layer, group)]], self.scales[self.row_of[(layer, group)]]
                row_scales = {"a_row_scales": [self.a_rs[k] for k in keys],
                              "b_row_scales": [self.b_rs[k] for k in keys]} if self.quantized else {}
                self.stacks[(layer, group)] = punica_kernels.lora_stack(
                    [self.a[k] for k in keys], [self.b[k] for k in keys], scales, ranks,
                    self.offsets.get(group), **row_scales)

    def write(self, slot: int, w: LoRAWeights) -> None:
        """Copy adapter `w` into `slot` (zeroing modules it does not target). `w` is quantized
        exactly when the slots are (the manager loads adapters in the slots' dtype)."""
        if w.quantized != self.quantized:
            raise ValueError(f"adapter {w.version} is {'' if w.quantized else 'not '}int8 but the slots are "
                             f"{'' if self.quantized else 'not '}int8")
        if w.rank > self.max_rank:
            raise ValueError(f"adapter {w.version} has rank {w.rank}, above the slots' {self.max_rank}")
        # Only the first r rows of A and columns of B (int8: B's first N * r entries) and their
        # scales are ever read for a slot of rank r in a stack (punica_kernels' contract), so a
        # module's copy zeroes only its padding up to its group's rank; a module the adapter does
        # not target is zeroed whole.
        ranks = [0] * len(self.row_of)
        scales = [0.0] * len(self.row_of)
        for (layer, group), row in self.row_of.items():
            mods = GROUPS[group]
            rg = ranks[row] = w.group_rank.get((layer, group), 0)
            scales[row] = w.group_scale.get((layer, group), 0.0)
            for m in mods:
                key = (layer, m)
                a, b = self.a[key], self.b[key]
                if key not in w.a:
                    a[slot].zero_()
                    b[slot].zero_()
                    if self.quantized:
                        self.a_rs[key][slot].zero_()
                        self.b_rs[key][slot].zero_()
                    continue
                rm = w.a[key].shape[0]
                a[slot, :rm].copy_(w.a[key])
                a[slot, rm:rg].zero_()
                if self.quantized:  # B rows packed at the stack's rank (punica_kernels.int8_b_view)
                    view = punica_kernels.int8_b_view(b, slot, rg)
                    view[:, :rm].copy_(w.b[key])
                    view[:, rm:].zero_()
                    self.a_rs[key][slot, :rm].copy_(w.a_scale[key])
                    self.a_rs[key][slot, rm:rg].zero_()
                    self.b_rs[key][slot].copy_(w.b_scale[key])
                else:
                    b[slot, :, :rm].copy_(w.b[key])
                    b[slot, :, rm:rg].zero_()
        self.ranks[:, slot] = torch.tensor(ranks, dtype=torch.int32)
        self.scales[:, slot] = torch.tensor(scales, dtype=torch.float32)

    def rank_in(self, slot: int, layer: int, group: str) -> int:
        """The rank slot `slot` has in the (layer, group) stack (the work its tokens cost there)."""
        return int(self.ranks[self.row_of[(layer, group)], slot])

    def clear(self, slot: int) -> None:
        self.ranks[:, slot] = 0
        self.scales[:, slot] = 0.0
