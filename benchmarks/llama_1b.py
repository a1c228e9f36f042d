"""A random-weight ~1B Llama, written on the spot for the benchmarks at scale (no download).

The shape is TinyLlama-1.1B's (22 layers, hidden 2048, 32 query / 4 KV heads of 64,
intermediate 5632, untied LM head) with SmolLM2's 49,152-token vocabulary, so the
default model's tokenizer serves it: 1.17B parameters. Three files come out of one
seed, all the same weights:

* ``hf/``: ``config.json``, bf16 safetensors and SmolLM2's ``tokenizer.json`` (rebuilt
  from the default GGUF by Folio's own GGUF tokenizer), what Folio and Hugging Face load;
* ``model-q8_0.gguf`` and ``model-q4_1.gguf``: that folder converted by llama.cpp's own
  ``convert_hf_to_gguf.py`` (from the sdist benchmarks/llamacpp.py unpacks) to f16,
  then ``llama-quantize --pure`` (every matrix in the one format, the embedding and LM
  head included, as Folio's kernels take them);
* ``model-q4_k_m.gguf``: the same f16 file through ``llama-quantize`` Q4_K_M, llama.cpp's
  own mix (Q4_K, with Q6_K for the LM head and for some layers' v_proj and down_proj),
  the format most GGUFs on the Hub come in.

Weights are N(0, 0.05) like benchmarks/random_checkpoints.py's full shapes.

    .venv/bin/pip install -e ".[bench]" torch==2.13.0          # sentencepiece, see below
    .venv/bin/python benchmarks/llama_1b.py /tmp/llama-1b      # writes, prints the paths

(llama.cpp's converter imports sentencepiece before it falls back to tokenizer.json.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import llamacpp  # noqa: E402
from benchmarks.random_checkpoints import architecture  # noqa: E402

SMOLLM2_VOCAB = 49152
FORMATS = ("q8_0", "q4_1", "q4_k_m")
MIXES = ("q4_k_m",)  # llama.cpp's per-tensor choice of formats, not --pure


def config_kwargs() -> dict:
    arch = dict(architecture("tinyllama-random"), vocab_size=SMOLLM2_VOCAB)
    return arch


def write_tokenizer(folder: Path) -> tuple[int, int]:
    """SmolLM2's tokenizer as Folio rebuilds it from the default GGUF (the right
    pre-tokenizer: transformers' GGUF conversion drops its digit rule, and llama.cpp's
    converter would then not recognise it), as ``tokenizer.json`` plus the config
    transformers reads; returns the (bos, eos) ids."""
    from model_files.gguf_file import GGUFFile
    from model_files.paths import default_model_path
    from text.gguf_tokenizer import build_gguf_tokenizer
    parts = build_gguf_tokenizer(GGUFFile(default_model_path()).metadata)
    folder.mkdir(parents=True, exist_ok=True)
    parts.tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": parts.bos_token,
        "eos_token": parts.eos_token, "chat_template": parts.chat_template,
        "add_bos_token": False, "clean_up_tokenization_spaces": False}, indent=1))
    vocab = parts.tokenizer.get_vocab()
    return vocab[parts.bos_token], vocab[parts.eos_token]


def write_hf(folder: Path, seed: int = 0) -> Path:
    """The bf16 checkpoint and SmolLM2's tokenizer in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    bos, eos = write_tokenizer(folder)
    if (folder / "model.safetensors").exists():
        return folder
    config = LlamaConfig(bos_token_id=bos, eos_token_id=eos, rms_norm_eps=1e-5,
                         initializer_range=0.05, torch_dtype="bfloat16", **config_kwargs())
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def convert(hf: Path, out: Path, fmt: str, jobs: int = 2) -> Path:
    """``hf`` as a GGUF in ``fmt``, by llama.cpp's converter and llama-quantize."""
    target = out / f"model-{fmt}.gguf"
    if target.exists():
        return target
    f16 = out / "model-f16.gguf"
    if not f16.exists():
        src = llamacpp.source_dir()
        env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), NO_LOCAL_GGUF="")
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf),
                        "--outtype", "f16", "--outfile", str(f16)], check=True, env=env)
    quantize = llamacpp.binary("llama-quantize") or llamacpp.build(jobs) / "llama-quantize"
    pure = [] if fmt in MIXES else ["--pure"]
    subprocess.run([str(quantize), *pure, str(f16), str(target), fmt.upper(), "2"],
                   check=True)
    return target


def write_all(out: Path, seed: int = 0, keep_f16: bool = False,
              formats: tuple[str, ...] = FORMATS) -> dict:
    hf = write_hf(out / "hf", seed)
    paths = {"hf": str(hf)}
    for fmt in formats:
        paths[fmt] = str(convert(hf, out, fmt))
    if not keep_f16:
        (out / "model-f16.gguf").unlink(missing_ok=True)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    args = ap.parse_args(argv)
    print(json.dumps(write_all(args.out, args.seed, formats=tuple(args.formats)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
