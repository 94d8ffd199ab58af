"""`tessera generate PROMPT`: stream the base model's answer to stdout: the embedded SmolLM2, or
`--model PATH` (a .gguf file or a Hugging Face checkpoint directory of any served family)."""
from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from typing import NoReturn


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
    p.add_argument("--model", default=None, metavar="PATH",
                   help="the base model: a .gguf file or a Hugging Face checkpoint directory (config.json + "
                        "*.safetensors) of a Llama, Mistral, Qwen2/3, Gemma 2/3 or Phi-3 model (default: the "
                        "embedded SmolLM2)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--backend", default=None, choices=["cpu", "triton"],
                   help="the engine's kernels (default: cpu on the CPU, triton on CUDA; "
                        "triton on the CPU runs only under TRITON_INTERPRET=1)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), "
                        "e.g. platform/tessera/demo_adapters/pirate")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check the arguments, load the model (and --adapter), then stream the answer; CLIError for
    anything the user can fix."""
    import logging

    from engine.sampling_params import GenerationRequest

    params = _sampling_params(args)
    if not args.prompt.strip():
        _fail("prompt is empty")
    logging.getLogger("engine").setLevel(logging.ERROR)  # errors reach the user once, as CLIError
    source, version = _adapter_source(args)
    engine = _load_engine(args, source)
    request = GenerationRequest(request_id=uuid.uuid4().hex, prompt=_prompt(args, engine), params=params,
                                adapter=version)
    _run_stream(engine, request)
    if engine.format_timings.get("summary"):  # the CPU weight formats this answer came from
        print(f"[{engine.format_timings['summary']}]", file=sys.stderr)
    return 0


def _fail(message: str) -> NoReturn:
    """Raise the CLI's one-line error."""
    from tessera.cli import CLIError

    raise CLIError(message) from None


def _sampling_params(args: argparse.Namespace):
    """The SamplingParams the flags ask for; CLIError when the engine refuses them."""
    from engine.sampling_params import InvalidRequestError, SamplingParams

    try:
        return SamplingParams.from_dict({
            "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": args.stop})
    except InvalidRequestError as e:
        _fail(str(e))


def _adapter_source(args: argparse.Namespace) -> tuple:
    """(adapter source, adapter name) for --adapter DIR (its parent folder holds it), else (None, None)."""
    if not args.adapter:
        return None, None
    from pathlib import Path

    from engine.lora.source import LocalDirectoryAdapterSource

    adapter_dir = Path(args.adapter).resolve()
    if not adapter_dir.is_dir():
        _fail(f"--adapter {args.adapter}: not a directory")
    return LocalDirectoryAdapterSource(adapter_dir.parent), adapter_dir.name


def _load_engine(args: argparse.Namespace, source):
    """The LLMEngine for --model; CLIError when the model cannot be found or read."""
    from engine.llm_engine import LLMEngine
    from tessera.engine_config import engine_config

    try:
        config = engine_config(device=args.device, backend=args.backend)
        return LLMEngine(args.model, config, adapter_source=source)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))


def _prompt(args: argparse.Namespace, engine) -> str:
    """The prompt as sent: plain text with --raw, else the chat template over --system and the message."""
    if args.raw:
        return args.prompt
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    return engine.tokenizer.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])


def _run_stream(engine, request) -> None:
    """Generate `request`, writing its text to stdout as it comes and a summary line to stderr;
    CLIError when the engine refuses the request or ends it with an error."""
    from engine.async_engine import AsyncLLMEngine
    from engine.sampling_params import InvalidRequestError

    async def stream() -> None:
        aengine = AsyncLLMEngine(engine)
        try:
            async for out in aengine.generate(request):
                sys.stdout.write(out.text)
                sys.stdout.flush()
                if out.finished:
                    sys.stdout.write("\n")
                    if out.error:
                        _fail(out.error)
                    print(f"[{out.finish_reason}; prompt {out.prompt_tokens} tokens, "
                          f"completion {out.completion_tokens} tokens]", file=sys.stderr)
        finally:
            aengine.shutdown()

    try:
        asyncio.run(stream())
    except InvalidRequestError as e:
        _fail(str(e))
