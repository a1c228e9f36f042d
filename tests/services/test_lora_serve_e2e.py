"""Multi-LoRA over HTTP: `folio serve` (tiny model, two API processes, adapters in the
YAML, runtime updates on, an API key) spoken to with the official ``openai`` client,
each API process also on its own unix socket so that both can be asked."""
import asyncio
import json
import os
import shutil

import httpx2 as httpx  # the openai client's own HTTP library
import openai
import pytest
import torch
from safetensors.torch import save_file

from engine_core.sampling_params import SamplingParams
from folio import LoRARequest
from tests.lora_adapters import AdapterSpec, edit_config, load_base, make_adapter
from tests.services.serve_process import ServeProcess, write_config

MODEL, KEY = "folio-tiny", "sk-lora-test"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(300, 340))]


@pytest.fixture(scope="module")
def folders(tiny_lora_adapters, tiny_llama_dir, tmp_path_factory):
    """allowed/: adapters to load at run time (good and bad); outside/: a good one."""
    root = tmp_path_factory.mktemp("lora_serve")
    allowed, outside = root / "allowed", root / "outside"
    shutil.copytree(tiny_lora_adapters["mlp4"], allowed / "mlp4")
    shutil.copytree(tiny_lora_adapters["mlp4"], outside / "mlp4")
    os.symlink(outside / "mlp4", allowed / "link")
    bad = {"modules_to_save": {"modules_to_save": ["lm_head"]}, "dora": {"use_dora": True},
           "unknown_target": {"target_modules": ["lm_head"]}}
    for name, changes in bad.items():
        edit_config(shutil.copytree(tiny_lora_adapters["qv8"], allowed / name), **changes)
    pickled = shutil.copytree(tiny_lora_adapters["qv8"], allowed / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    make_adapter(load_base(tiny_llama_dir), allowed / "rank32",
                 AdapterSpec(rank=32, targets=("q_proj",)))
    shapes = shutil.copytree(tiny_lora_adapters["qv8"], allowed / "shapes")
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               torch.ones(8, 96), "base_model.model.model.layers.0.self_attn.q_proj."
               "lora_B.weight": torch.ones(64, 8)}, str(shapes / "adapter_model.safetensors"))
    return root


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, default_model_path, tiny_lora_adapters, folders):
    config = write_config(
        folders / "folio.yaml", str(tiny_llama_dir), str(default_model_path),
        services={"num_api_servers": 2, "socket_dir": str(folders / "sock")},
        api={"api_keys": [KEY]}, scheduler={"max_num_seqs": 8},
        lora={"enable_lora": True, "max_loras": 2, "max_cpu_loras": 2,
              "allow_runtime_updates": True, "allowed_paths": [str(folders / "allowed")],
              "adapters": [{"name": n, "path": str(tiny_lora_adapters[n])}
                           for n in ("qv8", "all16")]})
    serve = ServeProcess(config, folders)
    serve.wait_ready()
    serve.sock_dir = folders / "sock"
    yield serve
    assert serve.stop() == 0, serve.output()[-3000:]


@pytest.fixture(scope="module")
def expected(make_tiny_llm_for_module, tiny_lora_adapters):
    """(adapter or None, prompt index) → the offline LLM's greedy text."""
    llm = make_tiny_llm_for_module
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = {}
    for i, name in enumerate([None, "qv8", "all16", "mlp4"]):
        lora = LoRARequest(name, i, str(tiny_lora_adapters[name])) if name else None
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False, lora_request=lora)
        out.update({(name, j): o.outputs[0].text for j, o in enumerate(outs)})
    return out


@pytest.fixture(scope="module")
def make_tiny_llm_for_module(tiny_llama_dir, default_model_path):
    from folio import LLM
    return LLM(model=str(tiny_llama_dir), tokenizer=str(default_model_path), dtype="float32",
               max_model_len=1024, num_blocks=256, enable_lora=True,
               **{"observability.log_level": "warning"})


def client(stack, api_index=None):
    """The openai client on the shared port, or on one API process's own socket."""
    if api_index is None:
        return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0)
    sock = str(stack.sock_dir / f"api-{api_index}.sock")
    http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=sock))
    return openai.AsyncOpenAI(base_url="http://api/v1", api_key=KEY, max_retries=0,
                              http_client=http)


async def complete(c, model, i, stream=False, max_tokens=12):
    """The greedy text of PROMPTS[i] on ``model`` (an adapter's name or the base)."""
    kw = dict(model=model, prompt=PROMPTS[i], max_tokens=max_tokens, temperature=0,
              extra_body={"ignore_eos": True})
    if not stream:
        return (await c.completions.create(**kw)).choices[0].text
    return "".join([chunk.choices[0].text async for chunk in
                    await c.completions.create(stream=True, **kw) if chunk.choices])


async def lora_post(stack, route, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=stack.url, headers=headers) as h:
        return await h.post(f"/v1/{route}_lora_adapter", json=body)


def run(coro):
    return asyncio.run(coro)


def test_models_list_each_adapter_with_the_base_as_parent(stack):
    async def main():
        models = (await client(stack).models.list()).data
        assert [(m.id, m.parent) for m in models] == [
            (MODEL, None), ("qv8", MODEL), ("all16", MODEL)]
    run(main())


def test_each_adapter_by_name_streaming_and_not(stack, expected):
    async def main():
        c = client(stack)
        for name in (None, "qv8", "all16"):
            for i in range(len(PROMPTS)):
                for stream in (False, True):
                    assert await complete(c, name or MODEL, i, stream) == expected[(name, i)]
        chat = await c.chat.completions.create(
            model="all16", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0)
        assert chat.model == "all16" and chat.choices[0].message.content is not None
    run(main())


def test_load_use_unload_then_404_on_every_api_process(stack, expected):
    async def main():
        r = await lora_post(stack, "load", {"lora_name": "mlp4",
                                            "lora_path": str(stack.sock_dir.parent / "allowed"
                                                             / "mlp4")})
        assert r.status_code == 200, r.text
        for api in (0, 1):  # both API processes know it at once: the engine core decides
            assert await complete(client(stack, api), "mlp4", 0) == expected[("mlp4", 0)]
            models = [m.id for m in (await client(stack, api).models.list()).data]
            assert "mlp4" in models
        again = await lora_post(stack, "load", {"lora_name": "mlp4", "lora_path": str(
            stack.sock_dir.parent / "allowed" / "mlp4")})
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        assert (await lora_post(stack, "unload", {"lora_name": "mlp4"})).status_code == 200
        for api in (0, 1):
            with pytest.raises(openai.NotFoundError) as err:
                await complete(client(stack, api), "mlp4", 0)
            assert err.value.body["code"] == "model_not_found"
        gone = await lora_post(stack, "unload", {"lora_name": "mlp4"})
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    run(main())


@pytest.mark.parametrize("folder,message", [
    ("pickled", "adapter_model.bin holds pickled weights"),
    ("modules_to_save", "modules_to_save is not supported"),
    ("dora", "DoRA adapters"),
    ("rank32", "rank 32 exceeds lora.max_lora_rank (16)"),
    ("shapes", "has shape (8, 96)"),
    ("unknown_target", "unknown target module 'lm_head'"),
    ("missing", "not a PEFT adapter folder"),
])
def test_bad_adapters_get_400_in_openais_shape(stack, folder, message):
    async def main():
        path = str(stack.sock_dir.parent / "allowed" / folder)
        r = await lora_post(stack, "load", {"lora_name": folder, "lora_path": path})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert message in err["message"] and err["type"] == "invalid_request_error"
        assert path not in err["message"]  # no server paths in errors
        with pytest.raises(openai.NotFoundError):  # and nothing was registered
            await complete(client(stack), folder, 0)
    run(main())


@pytest.mark.parametrize("path", ["outside/mlp4", "allowed/../outside/mlp4", "allowed/link"],
                         ids=["outside", "dotdot", "symlink"])
def test_paths_that_escape_allowed_paths_get_400(stack, path):
    async def main():
        r = await lora_post(stack, "load", {"lora_name": "escape",
                                            "lora_path": str(stack.sock_dir.parent) + "/" + path})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        assert "allowed_paths" in r.json()["error"]["message"]
    run(main())


def test_unknown_names_get_404_and_the_routes_need_the_key(stack):
    async def main():
        with pytest.raises(openai.NotFoundError) as err:
            await complete(client(stack), "no-such-adapter", 0)
        assert err.value.body["param"] == "model"
        r = await lora_post(stack, "load", {"lora_name": "x", "lora_path": "/"}, key=None)
        assert r.status_code == 401
        r = await lora_post(stack, "unload", {"lora_name": "qv8"}, key="sk-wrong")
        assert r.status_code == 401
    run(main())


def test_unloading_lets_requests_in_flight_finish_and_others_keep_being_served(stack,
                                                                                expected):
    async def main():
        c = client(stack)
        path = str(stack.sock_dir.parent / "allowed" / "mlp4")
        assert (await lora_post(stack, "load", {"lora_name": "mlp4",
                                                "lora_path": path})).status_code == 200
        long = asyncio.ensure_future(complete(c, "mlp4", 1, stream=True, max_tokens=200))
        base = asyncio.ensure_future(complete(c, MODEL, 0, stream=True))
        await asyncio.sleep(0.3)
        assert (await lora_post(stack, "unload", {"lora_name": "mlp4"})).status_code == 200
        text = await long
        assert text.startswith(expected[("mlp4", 1)]) and len(text) > len(expected[("mlp4", 1)])
        assert await base == expected[(None, 0)]
        for name in ("qv8", "all16"):  # with max_cpu_loras 2, mlp4 evicted one of them
            assert await complete(c, name, 0) == expected[(name, 0)]
    run(main())


def test_metrics_show_the_adapters(stack):
    async def main():
        await complete(client(stack), "qv8", 0)
        async with httpx.AsyncClient(base_url=stack.url,
                                     headers={"Authorization": f"Bearer {KEY}"}) as h:
            text = (await h.get("/metrics")).text
        assert 'folio:lora_requests_info{max_lora="2"' in text
        loaded = next(line for line in text.splitlines()
                      if line.startswith("folio:num_lora_adapters_loaded"))
        assert 1 <= float(loaded.split()[-1]) <= 2
        assert "folio:lora_loads_total" in text
    run(main())
