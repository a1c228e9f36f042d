"""``folio`` command line: serve, generate, chat, config."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from config.loader import load_config, parse_set_overrides
from config.schema import ConfigError, FolioConfig


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config (default: config/default.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _params(args):
    from engine_core.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed)


def _llm(args):
    from folio.llm import LLM
    config = load_config(args.config, parse_set_overrides(args.overrides))
    t0 = time.perf_counter()
    llm = LLM(config)
    print(f"[folio] model ready in {time.perf_counter() - t0:.1f}s "
          f"(weights loaded in {llm.runner.load_seconds:.1f}s)", file=sys.stderr)
    return llm


def cmd_generate(args) -> int:
    llm = _llm(args)
    params = _params(args)
    t0 = time.perf_counter()
    outputs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - t0
    num_tokens = 0
    for out in outputs:
        for c in out.outputs:
            print(c.text)
            num_tokens += len(c.token_ids)
    print(f"[folio] {num_tokens} tokens in {elapsed:.2f}s", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    llm = _llm(args)
    params = _params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; an empty line or Ctrl-D ends the chat.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(f"assistant> {reply}")
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_config(args) -> int:
    """Print every key with its resolved value and one-line doc."""
    config = load_config(args.config, parse_set_overrides(args.overrides))
    for section in dataclasses.fields(FolioConfig):
        obj = getattr(config, section.name)
        print(f"{section.name}:")
        for f in dataclasses.fields(obj):
            value = repr(getattr(obj, f.name))
            print(f"  {f.name + ':':<24}{value:<14} # {f.metadata.get('doc', '')}")
    return 0


def cmd_serve(args) -> int:
    """Start worker, engine core and API processes; supervise until SIGTERM/Ctrl-C."""
    from services.launcher import serve
    overrides = list(args.overrides)
    if args.host is not None:
        overrides.append(f"services.api_host={args.host}")
    if args.port is not None:
        overrides.append(f"services.api_port={args.port}")
    config = load_config(args.config, parse_set_overrides(overrides))
    return serve(config, args.config, overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Folio LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts")
    gen.add_argument("prompt", nargs="+")
    _add_common(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="talk to the model through its chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_common(chat)
    chat.set_defaults(func=cmd_chat)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API (three services)")
    srv.add_argument("--config", default=None, help="YAML config (default: config/default.yaml)")
    srv.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")
    srv.add_argument("--host", default=None, help="shorthand for --set services.api_host=...")
    srv.add_argument("--port", type=int, default=None,
                     help="shorthand for --set services.api_port=...")
    srv.set_defaults(func=cmd_serve)
    cfg = sub.add_parser("config", help="print the resolved config with each key's doc")
    cfg.add_argument("--config", default=None)
    cfg.add_argument("--set", dest="overrides", action="append", default=[])
    cfg.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"folio: config error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"folio: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
