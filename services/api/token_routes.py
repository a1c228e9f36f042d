"""``/tokenize`` and ``/detokenize``: the served tokenizer and chat template over HTTP.

Bodies are read and checked like generation bodies (size, JSON, Unicode, model name),
and a conversation passes the same shape check as a chat request before the template
renders it.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from text.chat_template import ChatTemplateError
from services.api.openai_protocol import bad
from services.api.request_validation import checked_messages, typed
from text.tokenizer import Tokenizer


class TokenRoutes:
    """The two tokenizer routes; ``read_body`` is the API's checked body reader."""

    def __init__(self, tokenizer: Tokenizer,
                 read_body: Callable[[web.Request], Awaitable[dict]], max_model_len: int):
        self.tokenizer, self.read_body, self.max_model_len = tokenizer, read_body, max_model_len

    def add_to(self, router: web.UrlDispatcher, expect_handler=None) -> None:
        router.add_post("/tokenize", self.tokenize, expect_handler=expect_handler)
        router.add_post("/detokenize", self.detokenize, expect_handler=expect_handler)

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"prompt": str}`` or ``{"messages": [...]}`` → token ids."""
        body = await self.read_body(request)
        if body.get("messages") is not None:
            try:
                text = self.tokenizer.apply_chat_template(checked_messages(body["messages"]))
            except ChatTemplateError as e:
                raise bad(str(e), "messages") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad("'prompt' must be a string", "prompt")
            special = (typed(body, "add_special_tokens", (bool,))
                       if body.get("add_special_tokens") is not None else True)
            ids = self.tokenizer.encode(prompt, special)
        return web.json_response({"tokens": ids, "count": len(ids),
                                  "max_model_len": self.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        """``{"tokens": [ids]}`` → text."""
        tokens = (await self.read_body(request)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(
                t, bool) and 0 <= t < self.tokenizer.vocab_size for t in tokens):
            raise bad("'tokens' must be a list of token ids in the vocabulary", "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})
