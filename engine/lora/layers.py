"""Device slots for adapters (the step's LoRA batch that reads them is the backend's:
engine.backends.base.LoRABatch).

The slot stacks hold, per (layer, fused group), one zero-padded A and B stack per slice:
    qkv:     A q/k/v [S, R, hidden]      B q [S, q, R], k/v [S, kv, R]
    o:       A [S, R, q]                 B [S, hidden, R]
    gate_up: A gate/up [S, R, hidden]    B gate/up [S, inter, R]
    down:    A [S, R, inter]             B [S, hidden, R]
A module an adapter does not target stays zero in its slot. `ranks[s]` is the slot's true rank,
so punica_kernels does work proportional to it, not to R. int8 slots also hold each row's fp32
scale: `a_rs[(layer, module)]` [S, R] and `b_rs[(layer, module)]` [S, out] (the adapters arrive
quantized: LoRAWeights.quantized).
"""
from __future__ import annotations

import torch

import punica_kernels
from engine.config import ModelConfig
from engine.lora.weights import LoRAWeights

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q", "k", "v"),
    "o": ("o",),
    "gate_up": ("gate", "up"),
    "down": ("down",),
}


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
        self.ranks = torch.zeros(S, dtype=torch.int32, device=device)
        self.scales = torch.zeros(S, dtype=torch.float32, device=device)
        self.num_layers = cfg.num_layers
        self.offsets = {"qkv": [0, cfg.q_size, cfg.q_size + cfg.kv_size], "gate_up": [0, cfg.intermediate_size]}
        # Each (layer, group)'s stacks checked once for punica_kernels.add_lora: a decode step makes
        # 4 calls a layer, and the stacks do not change between calls, so only the activations
        # are checked per call.
        self.stacks: dict[tuple[int, str], punica_kernels.LoRAStack] = {}
        for layer in range(cfg.num_layers):
            for group, mods in GROUPS.items():
                keys = [(layer, m) for m in mods]
                row_scales = {"a_row_scales": [self.a_rs[k] for k in keys],
                              "b_row_scales": [self.b_rs[k] for k in keys]} if self.quantized else {}
                self.stacks[(layer, group)] = punica_kernels.lora_stack(
                    [self.a[k] for k in keys], [self.b[k] for k in keys], self.scales, self.ranks,
                    self.offsets.get(group), **row_scales)

    def write(self, slot: int, w: LoRAWeights) -> None:
        """Copy adapter `w` into `slot` (zeroing modules it does not target). `w` is quantized
        exactly when the slots are (the manager loads adapters in the slots' dtype)."""
        if w.quantized != self.quantized:
            raise ValueError(f"adapter {w.version} is {'' if w.quantized else 'not '}int8 but the slots are "
                             f"{'' if self.quantized else 'not '}int8")
        r = w.rank
        # Only the first r rows of A and columns of B (int8: B's first N * r entries) and their
        # scales are ever read for a slot of rank r (punica_kernels' contract), so a targeted
        # module's copy needs no zeroing around it; a module the adapter does not target is zeroed.
        for key, a in self.a.items():
            if key in w.a:
                a[slot, :r].copy_(w.a[key])
                if self.quantized:  # B rows packed at the slot's rank (punica_kernels.int8_b_view)
                    punica_kernels.int8_b_view(self.b[key], slot, r).copy_(w.b[key])
                    self.a_rs[key][slot, :r].copy_(w.a_scale[key])
                    self.b_rs[key][slot].copy_(w.b_scale[key])
                else:
                    self.b[key][slot, :, :r].copy_(w.b[key])
            else:
                a[slot].zero_()
                self.b[key][slot].zero_()
                if self.quantized:
                    self.a_rs[key][slot].zero_()
                    self.b_rs[key][slot].zero_()
        self.ranks[slot] = r
        self.scales[slot] = w.scale

    def clear(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.scales[slot] = 0.0
