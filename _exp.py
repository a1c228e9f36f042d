import math, sys, torch
import kernels.paged_attention as pa
from benchmarks.perplexity import TEXT, negative_log_likelihoods
from folio import LLM
from text.tokenizer import Tokenizer
ids = Tokenizer.from_model_path("default").encode(TEXT.read_text())[:int(sys.argv[1])]
llm = LLM(model="default", dtype="bfloat16", max_model_len=4096, num_blocks=300, **{"observability.log_level": "warning"})
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
def fp8(dt, scale=1.0):
    def f(x, _):
        return (x.float() * scale).clamp(-448, 448).to(dt).float().div(scale).to(x.dtype) if dt == E4 else (x.float() * scale).to(dt).float().div(scale).to(x.dtype)
    return f
def rowwise_fp8(dt):
    def f(x, _):
        a = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-8) / torch.finfo(dt).max
        return (x.float() / a).to(dt).float().mul(a).to(x.dtype)
    return f
def rowwise_int8(x, _):
    a = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
    return (x.float() / a).round().clamp(-127, 127).mul(a).to(x.dtype)
variants = {"none": lambda x, _: x, "e4m3 s1": fp8(E4), "e4m3 x16": fp8(E4, 16.0),
            "e5m2 s1": fp8(E5), "e4m3 per-token-head": rowwise_fp8(E4),
            "int8 per-token-head": rowwise_int8}
base = None
for name, fn in variants.items():
    pa.round_through_cache = fn
    ppl = math.exp(negative_log_likelihoods(llm.runner, ids).mean().item())
    base = base or ppl
    print(f"{name:24s} {ppl:.4f} {100*(ppl/base-1):+.2f}%", flush=True)
