"""The API process's tokenizer threads: tokenization and chat templates off the loop.

Encoding a long prompt takes seconds of CPU (SmolLM2 splits every digit apart: 4 MB of
digits took 3-13 s), and on the event loop that stalls every request of the process.
Here it runs on threads. Measured on a 2-core machine (``benchmarks/tokenizer_gil.py``,
1 MiB of digits): ``tokenizers``' ``encode`` holds the GIL for its whole run (the main
thread stalled for all of it, 1.8-3.2 s), while ``encode_batch`` releases it (longest
main-thread stall 10-25 ms), so the tokenizer encodes through ``encode_batch`` and
threads suffice: no process pool, no copy of the text to another process. Chat templates
are Python (Jinja) and share the GIL, but a thread yields it every few milliseconds, so
the loop keeps answering.

Two lanes, so that a few huge texts cannot take the CPU that model execution and other
requests' prompts need:

- texts up to ``LONG_TEXT_CHARS`` characters go to one thread at the process's own
  priority (an ordinary prompt takes well under a millisecond there);
- longer ones go to ``api.num_tokenizer_threads`` threads that lower their own OS
  priority by ``LONG_TEXT_NICENESS`` when they start, so on a busy machine the kernel
  runs the worker's forward passes and the short lane first.

``tokenizers`` would otherwise split one text's work over its own Rayon threads, which
run at normal priority; the pool sets ``TOKENIZERS_PARALLELISM=false`` (unless the
operator set it), which ``tokenizers`` reads at each call, so a text is encoded on the
thread that asked. Work is bounded before it gets here: a text that cannot fit the context is refused
from its character count (``RequestValidator.check_prompt_text``), and a chat
conversation is rendered, checked the same way, and only then encoded.
"""
from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.api.openai_protocol import bad
from text.chat_template import ChatTemplateError
from text.tokenizer import Tokenizer

T = TypeVar("T")
LONG_TEXT_NICENESS = 10
LONG_TEXT_CHARS = 8192  # about 2,000 tokens: a millisecond or two of encoding


def lower_thread_priority(increment: int = LONG_TEXT_NICENESS) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux: per thread)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid)
                                                 + increment))
    except (OSError, AttributeError):  # not Linux, or not allowed: same priority
        pass


class TokenizerPool:
    """Runs one Tokenizer's encode, decode and chat rendering on worker threads."""

    def __init__(self, tokenizer: Tokenizer, num_threads: int,
                 allow_special_tokens_in_content: bool = False,
                 long_text_chars: int = LONG_TEXT_CHARS):
        self.tokenizer = tokenizer
        self.split_content = not allow_special_tokens_in_content
        self.long_text_chars = long_text_chars
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._short = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-short")
        self._long = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenizer-long",
                                        initializer=lower_thread_priority)

    def _lane(self, num_chars: int) -> ThreadPoolExecutor:
        return self._long if num_chars > self.long_text_chars else self._short

    async def _run(self, num_chars: int, fn: Callable[..., T], *args: Any,
                   **kwargs: Any) -> T:
        # A cancelled caller (client gone) cancels a job still queued; one already
        # running finishes, bounded by the character check that let it in.
        return await asyncio.get_running_loop().run_in_executor(
            self._lane(num_chars), functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(len(text), self.tokenizer.encode, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(len(token_ids), self.tokenizer.decode, token_ids)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          check_text: Callable[[str], None],
                          tools: list[dict[str, Any]] | None = None,
                          continue_final_message: bool = False) -> list[int]:
        """Render the conversation (with ``tools`` for templates that render them; the
        final message left open with ``continue_final_message``), pass its text to
        ``check_text`` (which raises to refuse it), then encode it; a template error is
        a 400 naming ``messages``."""
        return await self._run(_content_chars(messages), self._encode_chat, messages,
                               add_generation_prompt, check_text, tools,
                               continue_final_message)

    def _encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     check_text: Callable[[str], None],
                     tools: list[dict[str, Any]] | None,
                     continue_final_message: bool) -> list[int]:
        try:
            prompt = self.tokenizer.render_chat(messages, add_generation_prompt,
                                                split_content=self.split_content,
                                                tools=tools,
                                                continue_final_message=continue_final_message)
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
        self._short.shutdown(wait=False, cancel_futures=True)
        self._long.shutdown(wait=False, cancel_futures=True)


def _content_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the string parts of the messages (how long rendering will run)."""
    total = 0
    for message in messages:
        for value in message.values():
            if isinstance(value, str):
                total += len(value)
            elif isinstance(value, list):
                total += sum(len(part.get("text", "")) for part in value
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total
