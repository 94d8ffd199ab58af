"""PEFT adapters with rank_pattern / alpha_pattern (per-module ranks and alphas): PEFT-exact
logits, batched equal to alone, per-stack slot ranks, and max_lora_rank naming the module."""
import pytest
import torch

from engine.lora.source import LocalDirectoryAdapterSource
from engine.lora.weights import AdapterLoadError, load_lora_weights

from .conftest import chat
from .helpers import PROMPTS
from .lora_fixtures import write_random_adapter
from .test_lora import _engine_logits, _greedy

RANK_PATTERN = {"q_proj": 4, r"model\.layers\.[0-3]\.mlp\.down_proj": 16}
ALPHA_PATTERN = {"v_proj": 40}


@pytest.fixture(scope="module")
def root(tmp_path_factory, hf_model):
    """`patterned`: written by real PEFT (r=8 default, q_proj r=4, down_proj of layers 0-3 r=16,
    v_proj alpha 40) with random B so the adapter changes the logits; `plain-r8` beside it."""
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("rank_pattern")
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"],
                             rank_pattern=RANK_PATTERN, alpha_pattern=ALPHA_PATTERN, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(hf_model, config)
    try:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                elif "lora_A" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        model.save_pretrained(str(root / "patterned"))
    finally:
        model.unload()  # restore the shared HF model
    write_random_adapter(root / "plain-r8", 8, seed=11)
    return root


@pytest.fixture(scope="module")
def engine(make_engine, root):
    return make_engine(LocalDirectoryAdapterSource(root), max_loras=4, max_lora_rank=16)


def test_logits_match_peft(engine, root, hf_model, tokenizer):
    peft = pytest.importorskip("peft")
    ids = tokenizer.encode(chat(tokenizer, "What is the capital of France?"))
    ours = _engine_logits(engine, ids, "patterned")
    model = peft.PeftModel.from_pretrained(hf_model, str(root / "patterned"))
    try:
        ranks = {n: m.r["default"] for n, m in model.named_modules() if hasattr(m, "r") and "default" in m.r}
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float()
            with model.disable_adapter():
                plain = model(torch.tensor([ids])).logits[0].float()
    finally:
        model.unload()
    # PEFT really did give the modules different ranks (the test exercises the patterns).
    assert ranks["base_model.model.model.layers.0.self_attn.q_proj"] == 4
    assert ranks["base_model.model.model.layers.2.mlp.down_proj"] == 16
    assert ranks["base_model.model.model.layers.13.mlp.down_proj"] == 8
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-3, f"relative error {rel:.2e}"
    assert (ref - plain).abs().max() > 10 * (ours - ref).abs().max(), "the adapter must change the logits"


def test_slot_rank_per_stack_is_the_groups_largest_module_rank(engine):
    engine.generate([_greedy("load", PROMPTS[0], "patterned", n=1)])
    manager, slots = engine.lora_manager, engine.lora_manager.slots
    slot = next(s for s in range(slots.num_slots) if slots.rank_in(s, 2, "down") == 16)
    assert slots.rank_in(slot, 2, "down") == 16      # layers 0-3: down_proj r=16
    assert slots.rank_in(slot, 13, "down") == 8      # not the adapter's largest rank (16)
    assert slots.rank_in(slot, 0, "qkv") == 8        # q r=4 zero-padded to k/v's 8
    assert slots.rank_in(slot, 0, "o") == 8 and slots.rank_in(slot, 29, "gate_up") == 8
    assert slots.stacks[(13, "down")].ranks[slot] == 8  # the stack the kernels read holds it
    # v_proj's alpha (40/8 = 5) is folded into its B relative to the qkv stack's scale (16/8 = 2).
    assert slots.scales[slots.row_of[(0, "qkv")], slot] == pytest.approx(2.0)
    assert manager.load_error("patterned") is None


def test_mixed_batch_equals_alone(engine):
    adapters = ["patterned", "plain-r8", None, "patterned", None, "plain-r8"]
    reqs = [_greedy(f"m{i}", PROMPTS[i % len(PROMPTS)], a, n=8) for i, a in enumerate(adapters)]
    alone = {r.request_id: engine.generate([_greedy("solo", r.prompt, r.adapter, n=8)])["solo"].token_ids
             for r in reqs}
    together = engine.generate(reqs)
    for r in reqs:
        assert together[r.request_id].token_ids == alone[r.request_id], (r.request_id, r.adapter)
    assert alone["m0"] != alone["m2"] or alone["m3"] != alone["m4"]  # the adapter changes outputs


def test_rank_pattern_above_max_lora_rank_is_refused_naming_the_module(root, smollm_checkpoint):
    path = write_random_adapter(root / "too-big", 8, targets=("q_proj", "down_proj"), seed=3,
                                rank_pattern={"model.layers.7.mlp.down_proj": 32})
    with pytest.raises(AdapterLoadError, match=r"module model\.layers\.7\.mlp\.down_proj has rank 32 exceeds .*max_lora_rank 16"):
        load_lora_weights(path, "too-big", smollm_checkpoint[0], max_rank=16)
    w = load_lora_weights(path, "too-big", smollm_checkpoint[0], max_rank=32)
    assert w.a[(7, "down")].shape[0] == 32 and w.a[(6, "down")].shape[0] == 8 and w.rank == 32
