"""A CPU MLP pass whose gate/up output would reach the heap's mmap threshold runs in
equal row chunks (worker/models/llama.py: fresh mmapped pages fault on every write), with
the same result."""
import torch
from torch import nn

from worker.models import llama
from worker.models.linear import Linear


def mlp(hidden=64, inter=96, dtype=torch.bfloat16):
    m = llama.LlamaMLP.__new__(llama.LlamaMLP)
    nn.Module.__init__(m)
    m.tp, m.intermediate_size = None, inter
    m.gate_up_proj = Linear(hidden, 2 * inter, bias=False)
    m.down_proj = Linear(inter, hidden, bias=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lin in (m.gate_up_proj, m.down_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
    return m.to(dtype)


def test_chunk_rows_stay_under_the_threshold(monkeypatch):
    monkeypatch.setattr(llama, "MMAP_THRESHOLD", 2 ** 21)  # 2 MiB
    x = torch.zeros(1000, 8, dtype=torch.bfloat16)
    assert llama.mlp_chunk_rows(x, 256) == 1000  # 512 KB: one pass
    rows = llama.mlp_chunk_rows(x, 2048)  # 4 MB of gate/up output: chunks
    assert rows * 2048 * 2 <= 2 ** 21 * 7 // 8 and -(-1000 // rows) == 3
    assert llama.mlp_chunk_rows(x.to("meta"), 2048) == 1000  # not a CPU tensor


def test_a_chunked_pass_gives_the_same_bits(monkeypatch):
    m = mlp()
    x = torch.randn(300, 64).to(torch.bfloat16)
    with torch.inference_mode():
        whole = m(x)
        monkeypatch.setattr(llama, "MMAP_THRESHOLD", 60_000)  # 115 KB: 3 chunks
        passes = []
        monkeypatch.setattr(m, "_swiglu", lambda t, lora=None: passes.append(len(t))
                            or llama.LlamaMLP._swiglu(m, t, lora))
        chunked = m(x)
    assert passes == [100, 100, 100]
    assert torch.equal(whole, chunked)
