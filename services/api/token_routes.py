"""``/tokenize`` and ``/detokenize``: the served tokenizer and chat template over HTTP.

Bodies are read and checked like generation bodies (size, JSON, Unicode, model name),
a conversation passes the same shape check as a chat request before the template
renders it, and the work is bounded the same way: a text that must become more than
``max_model_len`` tokens is refused from its character count before it is tokenized,
and ``/detokenize`` takes at most ``max_model_len`` ids. The work itself runs on the
API process's tokenizer threads (tokenizer_pool.py), never on the event loop.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from services.api.fields import chat_prompt_flags, token_ids, typed
from services.api.openai_protocol import bad
from services.api.request_validation import RequestValidator, checked_messages
from services.api.tokenizer_pool import TokenizerPool
from services.api.tool_calls import check_tools


class TokenRoutes:
    """The two tokenizer routes; ``read_body`` is the API's checked body reader."""

    def __init__(self, tokens: TokenizerPool, validator: RequestValidator,
                 read_body: Callable[[web.Request], Awaitable[dict]]):
        self.tokens, self.validator, self.read_body = tokens, validator, read_body
        self.max_model_len = validator.limits.max_model_len

    def add_to(self, router: web.UrlDispatcher, expect_handler=None) -> None:
        router.add_post("/tokenize", self.tokenize, expect_handler=expect_handler)
        router.add_post("/detokenize", self.detokenize, expect_handler=expect_handler)

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"prompt": str}`` or ``{"messages": [...]}`` → token ids (and their
        vocabulary strings with ``return_token_strs``). A conversation takes the chat
        fields that shape its prompt: ``add_generation_prompt``, ``continue_final_message``
        and ``tools`` (rendered by templates that know them)."""
        body = await self.read_body(request)
        strs = (typed(body, "return_token_strs", (bool,))
                if body.get("return_token_strs") is not None else False)
        if body.get("messages") is not None:
            add, cont = chat_prompt_flags(body)
            tools = body.get("tools")
            if tools is not None:
                check_tools(tools)
            ids = await self.tokens.encode_chat(
                checked_messages(body["messages"]), add,
                lambda text: self.validator.check_prompt_text(text, "messages", room=0),
                tools, cont)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad("'prompt' must be a string", "prompt")
            special = (typed(body, "add_special_tokens", (bool,))
                       if body.get("add_special_tokens") is not None else True)
            self.validator.check_prompt_text(prompt, "prompt", room=0)
            ids = await self.tokens.encode(prompt, special)
        answer = {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}
        if strs:
            answer["token_strs"] = self.tokens.tokenizer.convert_ids_to_tokens(ids)
        return web.json_response(answer)

    async def detokenize(self, request: web.Request) -> web.Response:
        """``{"tokens": [ids]}`` → text."""
        tokens = token_ids((await self.read_body(request)).get("tokens"), "tokens",
                           self.tokens.tokenizer.vocab_size, self.max_model_len)
        return web.json_response({"prompt": await self.tokens.decode(tokens)})
