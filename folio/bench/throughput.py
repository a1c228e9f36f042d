"""`folio bench throughput`: the offline engine (``LLM.generate``) on a synthetic
workload, all requests submitted at once; output and total tokens per second."""
from __future__ import annotations

import time

from folio.bench.workload import BenchRequest


def bench_throughput(llm, requests: list[BenchRequest], ignore_eos: bool = True) -> dict:
    from engine_core.sampling_params import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=ignore_eos)
              for r in requests]
    prompts = [r.prompt for r in requests]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    return {"duration_s": elapsed, "num_requests": len(requests),
            "request_throughput": len(requests) / elapsed,
            "output_throughput": num_out / elapsed,
            "total_throughput": (num_in + num_out) / elapsed,
            "total_input_tokens": num_in, "total_output_tokens": num_out}
