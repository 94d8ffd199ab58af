"""`tessera generate PROMPT`: stream the embedded model's answer to stdout."""
from __future__ import annotations

import argparse
import asyncio
import sys
import uuid


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream the base model's answer to a prompt")
    p.add_argument("prompt", help="the user's message (chat-templated unless --raw)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--model", default=None, help="GGUF file or HF safetensors directory (default: embedded SmolLM2)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), "
                        "e.g. platform/tessera/demo_adapters/pirate")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tessera.cli import CLIError

    from engine.async_engine import AsyncLLMEngine
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import GenerationRequest, InvalidRequestError, SamplingParams

    try:
        params = SamplingParams.from_dict({
            "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": args.stop})
    except InvalidRequestError as e:
        raise CLIError(str(e)) from None
    if not args.prompt.strip():
        raise CLIError("prompt is empty")
    import logging

    logging.getLogger("engine").setLevel(logging.ERROR)  # errors reach the user once, as CLIError
    source = version = None
    if args.adapter:
        from pathlib import Path

        from engine.lora.source import LocalDirectoryAdapterSource

        adapter_dir = Path(args.adapter).resolve()
        if not adapter_dir.is_dir():
            raise CLIError(f"--adapter {args.adapter}: not a directory")
        source, version = LocalDirectoryAdapterSource(adapter_dir.parent), adapter_dir.name
    try:
        engine = LLMEngine(args.model, adapter_source=source)
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(str(e)) from None
    if args.raw:
        prompt = args.prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = engine.tokenizer.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])
    request = GenerationRequest(request_id=uuid.uuid4().hex, prompt=prompt, params=params, adapter=version)

    async def stream() -> None:
        aengine = AsyncLLMEngine(engine)
        try:
            async for out in aengine.generate(request):
                sys.stdout.write(out.text)
                sys.stdout.flush()
                if out.finished:
                    sys.stdout.write("\n")
                    if out.error:
                        raise CLIError(out.error)
                    print(f"[{out.finish_reason}; prompt {out.prompt_tokens} tokens, "
                          f"completion {out.completion_tokens} tokens]", file=sys.stderr)
        finally:
            aengine.shutdown()

    try:
        asyncio.run(stream())
    except InvalidRequestError as e:
        raise CLIError(str(e)) from None
    return 0
