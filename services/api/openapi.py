"""The OpenAPI 3.1 description of the API, served at ``GET /openapi.json``.

Bounds come from the live limits (max_model_len, vocabulary, the YAML's ``api``
section), so a fuzzer that reads this document probes exactly the edges the server
enforces. Every error response is OpenAI's ``{"error": {...}}`` shape.
"""
from __future__ import annotations

from typing import Any

from services.api.fields import INT64_MAX
from services.api.request_validation import ValidationLimits

_ERRORS = {"400": "invalid request", "401": "missing or wrong API key",
           "404": "unknown model or route", "413": "body too large",
           "431": "headers too large", "503": "engine unavailable or draining"}


# The server treats a null ``model`` as an absent one (the served model).
_MODEL = {"anyOf": [{"type": "string"}, {"type": "null"}]}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _responses(ok: dict, *codes: str) -> dict:
    out = {"200": {"description": "success", "content": ok}}
    for code in ("400", "401", "413", "431", *codes):
        out[code] = {"description": _ERRORS[code], "content": _json(_ref("Error"))}
    return out


def _sampling(lim: ValidationLimits) -> dict[str, Any]:
    """Fields shared by completions and chat completions."""
    num = {"type": "number"}
    int64 = {"type": "integer", "minimum": -INT64_MAX - 1, "maximum": INT64_MAX}
    nullable = lambda schema: {"anyOf": [schema, {"type": "null"}]}  # noqa: E731
    stop = {"type": "string", "minLength": 1, "maxLength": lim.max_stop_string_chars}
    return {
        "model": _MODEL, "stream": nullable({"type": "boolean"}),
        "stream_options": nullable({"type": "object", "properties": {
            "include_usage": {"type": "boolean"}}}),
        "n": nullable({"type": "integer", "minimum": 1, "maximum": lim.max_n}),
        "max_tokens": nullable({"type": "integer", "minimum": 1,
                                "maximum": lim.max_model_len - 1}),
        "min_tokens": nullable({"type": "integer", "minimum": 0,
                                "maximum": lim.max_model_len}),
        "temperature": nullable({**num, "minimum": 0, "maximum": 2}),
        "top_p": nullable({**num, "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": nullable({"type": "integer", "minimum": -1, "maximum": lim.vocab_size}),
        "min_p": nullable({**num, "minimum": 0, "maximum": 1}),
        "presence_penalty": nullable({**num, "minimum": -2, "maximum": 2}),
        "frequency_penalty": nullable({**num, "minimum": -2, "maximum": 2}),
        "repetition_penalty": nullable({**num, "exclusiveMinimum": 0, "maximum": 2 ** 16}),
        "seed": nullable(int64), "priority": nullable(int64),
        "stop": nullable({"anyOf": [stop, {"type": "array", "maxItems": lim.max_stop_strings,
                                           "items": stop}]}),
        "stop_token_ids": nullable({"type": "array", "maxItems": lim.max_stop_token_ids,
                                    "items": _token_id(lim)}),
        "ignore_eos": nullable({"type": "boolean"}),
        "skip_special_tokens": nullable({"type": "boolean"}),
        "include_stop_str_in_output": nullable({"type": "boolean"}),
        "user": nullable({"type": "string"}),
        **_structured(lim, nullable),
    }


def _structured(lim: ValidationLimits, nullable) -> dict[str, Any]:
    """The fields that constrain the output (services/api/structured_request.py); the
    server checks more than this says (the grammar must compile)."""
    text = {"type": "string", "minLength": 1, "maxLength": lim.max_grammar_chars}
    choice = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
    schema = {"anyOf": [{"type": "object"}, {"type": "string"}]}
    json_schema = {"type": "object", "required": ["schema"], "properties": {
        "name": {"type": "string"}, "schema": {"type": "object"},
        "strict": nullable({"type": "boolean"})}}
    return {
        "response_format": nullable({"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": json_schema}}),
        "structured_outputs": nullable({"type": "object", "properties": {
            "json": schema, "regex": text, "choice": choice, "grammar": text,
            "json_object": {"type": "boolean"}}}),
        "guided_json": nullable(schema), "guided_regex": nullable(text),
        "guided_choice": nullable(choice), "guided_grammar": nullable(text),
    }


def _tools() -> dict[str, Any]:
    """Chat only: function calling (services/api/tool_calls.py)."""
    function = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": "string"}, "parameters": {"type": "object"}}}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": function}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}}}}}
    return {"tools": {"anyOf": [{"type": "array", "items": tool}, {"type": "null"}]},
            "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, named,
                                      {"type": "null"}]},
            "parallel_tool_calls": {"type": ["boolean", "null"]}}


def _token_id(lim: ValidationLimits) -> dict:
    return {"type": "integer", "minimum": 0, "maximum": lim.vocab_size - 1}


def _schemas(lim: ValidationLimits) -> dict[str, Any]:
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens",
                                            "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"}, "prompt_tokens_details": {
            "type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
    choice = {"type": "object", "required": ["index", "finish_reason"]}
    part = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "text"}, "text": {"type": "string"}}}
    # content may be null or left out only by an assistant message that calls tools
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part},
                              {"type": "null"}]},
        "tool_calls": {"type": "array"}},
        "anyOf": [{"required": ["content"]}, {"required": ["tool_calls"]}]}
    ids = {"type": "array", "minItems": 1, "items": _token_id(lim)}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string", "maxLength": 1000},
                           "type": {"type": "string"},
                           "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "null"]}}}}},
        "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": {
            **_sampling(lim),
            "prompt": {"anyOf": [  # text, ids, or a batch of those
                {"type": "string", "minLength": 1}, ids,
                {"type": "array", "minItems": 1, "maxItems": lim.max_batch_prompts, "items": {
                    "anyOf": [{"type": "string", "minLength": 1}, ids]}}]},
            "logprobs": {"type": ["integer", "null"], "minimum": 0,
                         "maximum": lim.max_logprobs}}},
        "ChatRequest": {"type": "object", "required": ["messages"], "properties": {
            **_sampling(lim), **_tools(),
            "messages": {"type": "array", "minItems": 1, "items": message},
            "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1,
                                      "maximum": lim.max_model_len - 1},
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": {"type": ["integer", "null"], "minimum": 0,
                             "maximum": lim.max_logprobs},
            "add_generation_prompt": {"type": ["boolean", "null"]},
            "continue_final_message": {"type": ["boolean", "null"]}}},
        "Completion": {"type": "object", "required": ["id", "object", "choices", "usage"],
                       "properties": {"choices": {"type": "array", "items": choice},
                                      "usage": usage}},
        "TokenizeRequest": {"anyOf": [
            {"type": "object", "required": ["prompt"], "properties": {
                "model": _MODEL, "prompt": {"type": "string"},
                "add_special_tokens": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
                "return_token_strs": {"type": ["boolean", "null"]}}},
            {"type": "object", "required": ["messages"], "properties": {
                "model": _MODEL, "tools": _tools()["tools"],
                "messages": {"type": "array", "minItems": 1, "items": message},
                "add_generation_prompt": {"type": ["boolean", "null"]},
                "continue_final_message": {"type": ["boolean", "null"]},
                "return_token_strs": {"type": ["boolean", "null"]}}}]},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
            "model": _MODEL, "tokens": {"type": "array", "maxItems": lim.max_model_len,
                                        "items": _token_id(lim)}}},
    }


def openapi_document(version: str, model_name: str, lim: ValidationLimits,
                     auth: bool) -> dict[str, Any]:
    """The whole document; with ``auth`` every operation but /health needs a bearer key."""
    sse = {"text/event-stream": {"schema": {"type": "string"}}}
    generate = {**_json(_ref("Completion")), **sse}
    text = {"text/plain": {"schema": {"type": "string"}}}

    def post(summary: str, schema: str, ok: dict, *codes: str) -> dict:
        return {"post": {"summary": summary, "requestBody": {
            "required": True, "content": _json(_ref(schema))},
            "responses": _responses(ok, *codes)}}

    def get(summary: str, ok: dict, *codes: str) -> dict:
        return {"get": {"summary": summary, "responses": _responses(ok, *codes)}}

    obj = _json({"type": "object"})
    paths = {
        "/v1/completions": post("text completion", "CompletionRequest", generate, "404",
                                "503"),
        "/v1/chat/completions": post("chat completion", "ChatRequest", generate, "404",
                                     "503"),
        "/tokenize": post("prompt or conversation to token ids", "TokenizeRequest", obj,
                          "404"),
        "/detokenize": post("token ids to text", "DetokenizeRequest", obj, "404"),
        "/v1/models": get(f"the served model ({model_name})", obj),
        "/version": get("server version", obj),
        "/metrics": get("Prometheus metrics", text, "404", "503"),
        "/health": get("liveness (public); engine gauges with a key", obj, "503"),
        "/openapi.json": get("this document", obj),
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0", "info": {"title": "Folio OpenAI-compatible API",
                                     "version": version},
        "paths": paths, "components": {"schemas": _schemas(lim)}}
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                           "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        paths["/health"]["get"]["security"] = []
    return doc
