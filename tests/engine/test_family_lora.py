"""PEFT LoRA adapters on every served family, against PEFT's own logits.

For each family (tests/engine/family_models.py) two adapters are made with peft on the
transformers model: one on "all-linear" (for Phi-3 that is its fused qkv_proj and gate_up_proj)
at rank 8, one on the attention projections only at rank 4 with its own alpha. The engine serves
them in one batch beside a base-model request (and one adapter alone first); every sampled
logits row is within LOGITS_RTOL of PEFT's forward with that adapter active (or disabled for
the base request), and the greedy tokens are PEFT's.
"""
from __future__ import annotations

import pytest
import torch

from engine.lora.source import LocalDirectoryAdapterSource
from engine.sampling_params import GenerationRequest, SamplingParams

from .family_models import FAMILIES, VOCAB, build_family_model, hf_greedy
from .test_families import LOGITS_RTOL, assert_rows_close, family_engine, run_recording, tokenizer  # noqa: F401

STEPS = 6


def _attention_targets(family: str) -> list[str]:
    return ["qkv_proj", "o_proj"] if family == "phi3" else ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_with_adapters(request, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    name = request.param
    root = tmp_path_factory.mktemp(f"{name}-lora")
    model = build_family_model(name, root / "base", seed=5)
    adapters = {"all-linear": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                "attn": LoraConfig(r=4, lora_alpha=12, target_modules=_attention_targets(name))}
    peft_model = None
    for i, (adapter, config) in enumerate(adapters.items()):
        if peft_model is None:
            peft_model = get_peft_model(model, config, adapter_name=adapter)
        else:
            peft_model.add_adapter(adapter, config)
        torch.manual_seed(100 + i)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if f"lora_B.{adapter}." in pname or f"lora_A.{adapter}." in pname:
                    p.copy_(torch.randn_like(p) * 0.3 / p.shape[-1] ** 0.5)
    for adapter in adapters:
        peft_model.save_pretrained(root / "saved", selected_adapters=[adapter])
    peft_model.eval()
    return name, root, peft_model


def _saved_dir(root, adapter: str):
    # save_pretrained writes a named (non-"default") adapter under its name.
    return root / "saved" / adapter


def _reference(peft_model, adapter: str | None, prompt: list[int]):
    if adapter is None:
        with peft_model.disable_adapter():
            return hf_greedy(peft_model, prompt, STEPS)
    peft_model.set_adapter(adapter)
    return hf_greedy(peft_model, prompt, STEPS)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_peft_adapters_match_peft_alone_and_mixed_with_the_base(family_with_adapters, backend, tokenizer, tmp_path):
    name, root, peft_model = family_with_adapters
    # The engine fetches adapter versions by id from a directory of adapter directories.
    source_root = tmp_path / "versions"
    source_root.mkdir()
    for adapter in ("all-linear", "attn"):
        (source_root / adapter).symlink_to(_saved_dir(root, adapter).resolve())
    engine = family_engine(root / "base", backend, tokenizer, adapter_source=LocalDirectoryAdapterSource(source_root),
                           max_loras=2, max_lora_rank=8)
    g = torch.Generator().manual_seed(7)
    prompts = {rid: torch.randint(3, VOCAB, (n,), generator=g).tolist()
               for rid, n in (("all-linear", 29), ("attn", 18), ("base", 23))}
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)

    # One adapter alone (chunked prefill, decode).
    tokens, rows, _ = run_recording(engine, [GenerationRequest("alone", prompt_token_ids=prompts["attn"],
                                                               params=params, adapter="attn")])
    want_tokens, want_logits = _reference(peft_model, "attn", prompts["attn"])
    assert tokens["alone"] == want_tokens, f"{name}/{backend}: greedy tokens differ from PEFT's"
    assert_rows_close(rows["alone"], want_logits, f"{name}/{backend} adapter alone")

    # Both adapters and the base in one batch.
    requests = [GenerationRequest(rid, prompt_token_ids=prompts[rid], params=params,
                                  adapter=None if rid == "base" else rid) for rid in prompts]
    tokens, rows, _ = run_recording(engine, requests)
    for rid in prompts:
        want_tokens, want_logits = _reference(peft_model, None if rid == "base" else rid, prompts[rid])
        assert tokens[rid] == want_tokens, f"{name}/{backend} {rid}: greedy tokens differ from PEFT's"
        assert_rows_close(rows[rid], want_logits, f"{name}/{backend} {rid} in a mixed batch")
    # The adapters change the outputs (so what is compared is their term).
    with peft_model.disable_adapter():
        base_logits = hf_greedy(peft_model, prompts["all-linear"], 1)[1]
    assert not torch.allclose(rows["all-linear"][0], base_logits[0], atol=1e-2)
