"""``folio`` command line: serve, generate, chat, config."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from config.loader import load_config, parse_set_overrides
from config.schema import ConfigError, FolioConfig


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config (default: config/default.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")


def _add_common(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
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
    """Print every key with its resolved value and one-line doc (``--resolved``: the
    resolved tree as YAML, secrets redacted, as the services log it at debug level)."""
    config = load_config(args.config, parse_set_overrides(args.overrides))
    if args.resolved:
        import yaml
        from config.loader import config_to_dict
        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
        return 0
    for section in dataclasses.fields(FolioConfig):
        obj = getattr(config, section.name)
        print(f"{section.name}:")
        for f in dataclasses.fields(obj):
            value = "<redacted>" if f.metadata.get("secret") else repr(getattr(obj, f.name))
            print(f"  {f.name + ':':<24}{value:<14} # {f.metadata.get('doc', '')}")
    return 0


def cmd_tenant_id(args) -> int:
    """Print the tenant id of an API key (what ``api.tenant_weights`` is keyed by)."""
    from services.tenants import key_digest, tenant_id
    key = args.key if args.key != "-" else sys.stdin.readline().strip()
    print(tenant_id(key_digest(key)))
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


def _add_workload(p: argparse.ArgumentParser) -> None:
    from folio.bench.workload import DATASETS
    p.add_argument("--dataset", choices=DATASETS, default="uniform")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="uniform: lengths in len*(1 -/+ ratio)")
    p.add_argument("--prefix-len", type=int, default=1000,
                   help="shared-prefix: tokens of the shared system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (lengths then vary)")
    p.add_argument("--result-json", default=None, help="write the report here")


def _workload(args, tokenizer):
    from folio.bench.workload import make_workload
    return make_workload(tokenizer, args.dataset, args.num_prompts, args.input_len,
                         args.output_len, args.range_ratio, args.prefix_len, args.seed)


def _write_json(path, data) -> None:
    import json
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")


def cmd_bench_serve(args) -> int:
    """Load an OpenAI-compatible server and report latency and throughput."""
    from folio.bench.serve import LoadSpec, bench_serve, format_report, plot_sweep
    from text.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_model_path(args.tokenizer)
    requests = _workload(args, tokenizer)
    slo = dict(_slo(item) for item in args.goodput)
    rates = args.sweep_rates or [args.request_rate]
    reports = []
    for rate in rates:
        spec = LoadSpec(rate, args.burstiness, args.max_concurrency, args.seed)
        report = bench_serve(args.base_url, args.model, requests, spec, slo or None,
                             args.ignore_eos)
        report["workload"] = {k: getattr(args, k) for k in (
            "dataset", "num_prompts", "input_len", "output_len", "range_ratio",
            "prefix_len", "seed", "ignore_eos")}
        reports.append(report)
        print(f"--- request rate {rate:g}/s, max concurrency {args.max_concurrency}")
        print(format_report(report), flush=True)
    _write_json(args.result_json, reports if len(reports) > 1 else reports[0])
    if args.plot:
        plot_sweep(reports, args.plot)
        print(f"[folio] plot written to {args.plot}", file=sys.stderr)
    return 0 if all(r["completed"] for r in reports) else 1


def _slo(item: str) -> tuple[str, float]:
    key, _, value = item.partition(":")
    if key not in ("ttft", "tpot", "e2e") or not value:
        raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, got {item!r}")
    return key, float(value)


def cmd_bench_throughput(args) -> int:
    """The offline engine on a synthetic workload."""
    from folio.bench.throughput import bench_throughput
    llm = _llm(args)
    report = bench_throughput(llm, _workload(args, llm.get_tokenizer()), args.ignore_eos)
    print(f"{report['num_requests']} requests in {report['duration_s']:.1f}s: "
          f"{report['request_throughput']:.2f} req/s, "
          f"output {report['output_throughput']:.1f} tok/s, "
          f"total {report['total_throughput']:.1f} tok/s")
    _write_json(args.result_json, report)
    return 0


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
    _add_config_args(srv)
    srv.add_argument("--host", default=None, help="shorthand for --set services.api_host=...")
    srv.add_argument("--port", type=int, default=None,
                     help="shorthand for --set services.api_port=...")
    srv.set_defaults(func=cmd_serve)
    bench = sub.add_parser("bench", help="benchmarks: serve (any OpenAI server), throughput")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bs = bench_sub.add_parser("serve", help="load an OpenAI-compatible endpoint")
    bs.add_argument("--base-url", default="http://127.0.0.1:8000")
    bs.add_argument("--model", default="SmolLM2-135M-Instruct")
    bs.add_argument("--tokenizer", default="default",
                    help="builds the prompts (a GGUF, tokenizer.json or 'default')")
    bs.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second (Poisson); inf sends all at once")
    bs.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps: 1 Poisson, < 1 burstier")
    bs.add_argument("--max-concurrency", type=int, default=None)
    bs.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                    help="latency targets, e.g. ttft:500 tpot:100 e2e:10000")
    bs.add_argument("--sweep-rates", type=float, nargs="*", default=None,
                    help="run once per rate (for a throughput-latency curve)")
    bs.add_argument("--plot", default=None, help="PNG of throughput vs latency (sweep)")
    _add_workload(bs)
    bs.set_defaults(func=cmd_bench_serve)
    bt = bench_sub.add_parser("throughput", help="the offline engine on a workload")
    _add_config_args(bt)
    _add_workload(bt)
    bt.set_defaults(func=cmd_bench_throughput)
    cfg = sub.add_parser("config", help="print the resolved config with each key's doc")
    _add_config_args(cfg)
    cfg.add_argument("--resolved", action="store_true",
                     help="print the resolved tree as YAML (secrets redacted)")
    cfg.set_defaults(func=cmd_config)
    tid = sub.add_parser("tenant-id", help="the tenant id of an API key (api.tenant_weights)")
    tid.add_argument("key", help="the API key, or - to read it from stdin (keeps it out of ps)")
    tid.set_defaults(func=cmd_tenant_id)
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
