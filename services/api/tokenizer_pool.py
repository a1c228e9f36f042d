"""The API process's tokenizer threads: tokenization and chat templates off the loop.

Encoding a long prompt takes seconds of CPU (SmolLM2 splits every digit apart: 4 MB of
digits took 3-13 s), and on the event loop that stalls every request of the process.
Here it runs on ``api.num_tokenizer_threads`` threads. Measured on a 2-core machine
(``benchmarks/tokenizer_gil.py``, 1 MiB of digits): ``tokenizers``' ``encode`` holds
the GIL for its whole run (the main thread stalled for all of it, 1.8-3.2 s), while
``encode_batch`` releases it (longest main-thread stall 10-25 ms), so the tokenizer
encodes through ``encode_batch`` and threads suffice: no process pool, no copy of the
text to another process. Chat templates are Python (Jinja) and share the GIL, but a
thread yields it every few milliseconds, so the loop keeps answering.

Work is bounded before it gets here: a text that cannot fit the context is refused
from its character count (``RequestValidator.check_prompt_text``), and a chat
conversation is rendered, checked the same way, and only then encoded.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.api.openai_protocol import bad
from text.chat_template import ChatTemplateError
from text.tokenizer import Tokenizer

T = TypeVar("T")


class TokenizerPool:
    """Runs one Tokenizer's encode, decode and chat rendering on worker threads."""

    def __init__(self, tokenizer: Tokenizer, num_threads: int,
                 allow_special_tokens_in_content: bool = False):
        self.tokenizer = tokenizer
        self.split_content = not allow_special_tokens_in_content
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenizer")

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        # A cancelled caller (client gone) cancels a job still queued; one already
        # running finishes, bounded by the character check that let it in.
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self.tokenizer.encode, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, token_ids)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          check_text: Callable[[str], None],
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render the conversation (with ``tools`` for templates that render them), pass
        its text to ``check_text`` (which raises to refuse it), then encode it; a
        template error is a 400 naming ``messages``."""
        return await self._run(self._encode_chat, messages, add_generation_prompt,
                               check_text, tools)

    def _encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     check_text: Callable[[str], None],
                     tools: list[dict[str, Any]] | None) -> list[int]:
        try:
            prompt = self.tokenizer.render_chat(messages, add_generation_prompt,
                                                split_content=self.split_content,
                                                tools=tools)
        except ChatTemplateError as e:
            raise bad(str(e), "messages") from None
        # The rendered text is what gets encoded (content pieces as plain text, which
        # only adds tokens), so its length bounds the token count. The contents' total
        # length is no bound: a template may drop or trim content (only the last turns,
        # reasoning cut from assistant turns), and then fewer tokens result.
        check_text(prompt.text)
        return self.tokenizer.encode_chat(prompt)

    def close(self) -> None:
        """Stop the threads; queued jobs are cancelled."""
        self._executor.shutdown(wait=False, cancel_futures=True)
