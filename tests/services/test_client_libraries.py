"""Issue 18, "a real client": the client libraries that users point at Folio by
changing the base URL (litellm, langchain-openai) make their basic calls against a
real `folio serve` (tiny Llama, the default model's tokenizer): chat, text completion
and streaming, with the answers' tokens checked against the offline ``LLM``."""
from __future__ import annotations

import os

import pytest

from engine_core.sampling_params import SamplingParams
from tests.services.serve_process import running, write_config

MODEL = "folio-tiny"
PROMPT = "The capital of France is"
HI = [{"role": "user", "content": "Hi"}]

# litellm fetches its model price list from the internet at import unless told not to
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, default_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clients")
    config = write_config(tmp / "folio.yaml", str(tiny_llama_dir), str(default_model_path))
    with running(config, tmp) as serve:
        yield serve


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, default_model_path):
    """The offline LLM's greedy texts: 5 tokens after PROMPT, and the chat reply to HI."""
    from folio import LLM
    llm = LLM(model=str(tiny_llama_dir), tokenizer=str(default_model_path), dtype="float32",
              max_model_len=1024, num_blocks=256, **{"observability.log_level": "warning"})
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    return {"completion": llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text,
            "chat": llm.chat(HI, greedy, use_tqdm=False)[0].outputs[0].text}


def test_litellm_chat_text_completion_and_stream(stack, expected):
    litellm = pytest.importorskip("litellm")
    common = dict(model=f"openai/{MODEL}", api_base=stack.url + "/v1", api_key="none",
                  max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    chat = litellm.completion(messages=HI, **common)
    assert chat.choices[0].message.content == expected["chat"]
    assert chat.usage.completion_tokens == 5
    text = litellm.text_completion(prompt=PROMPT, **common)
    assert text.choices[0].text == expected["completion"]
    chunks = litellm.completion(messages=HI, stream=True, **common)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["chat"]


def test_langchain_openai_chat_llm_and_stream(stack, expected):
    langchain_openai = pytest.importorskip("langchain_openai")
    common = dict(model=MODEL, base_url=stack.url + "/v1", api_key="none", max_tokens=5,
                  temperature=0, max_retries=0, extra_body={"ignore_eos": True})
    chat = langchain_openai.ChatOpenAI(**common)
    reply = chat.invoke([("user", "Hi")])
    assert reply.content == expected["chat"]
    assert reply.usage_metadata["output_tokens"] == 5
    assert "".join(c.content for c in chat.stream([("user", "Hi")])) == expected["chat"]
    llm = langchain_openai.OpenAI(**common)
    assert llm.invoke(PROMPT) == expected["completion"]
