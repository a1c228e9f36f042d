"""Native llama.cpp binaries for the baselines, built from the source vendored in the
``llama-cpp-python`` sdist, cached in the git-ignored ``.llamacpp/`` folder.

    .venv/bin/python benchmarks/llamacpp.py [JOBS]     # build (5-15 minutes on 2 cores)

``GGML_NATIVE=ON`` built binaries that died with SIGILL on an AMX Xeon, so the build
names its instruction sets: AVX2/FMA/F16C always, AVX-512 (+VNNI, +BF16) when this CPU
has them, AMX off. The folder is keyed by those flags, so a cache copied to another
kind of CPU is never used there. ``llama-bench``, ``llama-perplexity``, ``llama-quantize``
(benchmarks/llama_1b.py) and
``llama-server`` are built.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import cpu_model_and_flags  # noqa: E402

VERSION = "0.3.36"
CACHE = REPO / ".llamacpp"
TARGETS = ("llama-bench", "llama-perplexity", "llama-quantize", "llama-server")


def cmake_options() -> list[str]:
    _, flags = cpu_model_and_flags()
    on = lambda cond: "ON" if cond else "OFF"  # noqa: E731
    return ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_CURL=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
            "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
            f"-DGGML_AVX512={on('avx512f' in flags)}",
            f"-DGGML_AVX512_VNNI={on('avx512_vnni' in flags)}",
            f"-DGGML_AVX512_BF16={on('avx512_bf16' in flags)}",
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def binary_dir() -> Path:
    # "-DGGML_AVX512_VNNI=ON" -> "avx512_vnni": the instruction sets this build uses
    key = "-".join(o.split("=")[0].removeprefix("-DGGML_").lower() for o in cmake_options()
                   if o.startswith("-DGGML_") and o.endswith("=ON"))
    return CACHE / f"{VERSION}-{key}" / "bin"


def binary(name: str) -> Path | None:
    path = binary_dir() / name
    return path if path.exists() else None


def source_dir() -> Path:
    """The llama.cpp tree vendored in the sdist, unpacked once under CACHE."""
    root = CACHE / f"src-{VERSION}"
    found = list(root.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if found:
        return found[0].parent
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                        "--no-deps", f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        partial = root.with_suffix(".partial")
        with tarfile.open(sdist) as tar:
            tar.extractall(partial, filter="data")
        partial.rename(root)
    return source_dir()


def build(jobs: int = 2) -> Path:
    """Download the sdist (pip), configure and build TARGETS; returns the binary folder.
    The build folder stays under CACHE, so a build that was stopped resumes."""
    out = binary_dir()
    if all((out / t).exists() for t in TARGETS):
        return out
    build_dir = out.parent / "build"
    subprocess.run(["cmake", "-S", str(source_dir()), "-B", str(build_dir), "-G", "Ninja",
                    *cmake_options()], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target",
                    *TARGETS], check=True)
    out.mkdir(parents=True, exist_ok=True)
    for target in TARGETS:
        (out / target).write_bytes((build_dir / "bin" / target).read_bytes())
        (out / target).chmod(0o755)
    (out.parent / "build.json").write_text(json.dumps({"version": VERSION,
                                                       "cmake": cmake_options()}, indent=1))
    return out


def llama_bench(gguf: Path, threads: int, tokens: int = 128, repetitions: int = 5) -> dict:
    """``llama-bench`` text generation (tg<tokens>) on ``gguf``: tokens/s mean and sd."""
    exe = binary("llama-bench")
    if exe is None:
        raise RuntimeError("llama-bench is not built: run benchmarks/llamacpp.py")
    proc = subprocess.run([str(exe), "-m", str(gguf), "-t", str(threads), "-p", "0",
                           "-n", str(tokens), "-r", str(repetitions), "-o", "json"],
                          capture_output=True, text=True, timeout=1200, check=True)
    row = json.loads(proc.stdout)[0]
    return {"test": f"tg{tokens}", "threads": threads, "tok_s": row["avg_ts"],
            "tok_s_sd": row["stddev_ts"], "build": row.get("build_commit")}


if __name__ == "__main__":
    print(build(int(sys.argv[1]) if len(sys.argv) > 1 else 2))
