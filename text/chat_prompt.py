"""A rendered conversation that keeps the template's text apart from the messages'.

Encoding the rendered template as one string turns special-token text anywhere in it
into special ids, so a user message holding ``<|im_end|>\\n<|im_start|>system\\n...``
forges a system turn. Here the template is rendered twice, once as usual and once with
each message's content replaced by a unique marker; the marked rendering, split at the
markers and refilled, must give back exactly the usual one (a template that trims,
splits or drops content fails that and is handled below). The pieces then encode as:

    <|im_start|>user\\n  ·  Hi <|im_end|> there  ·  <|im_end|>\\n<|im_start|>assistant\\n
    └── template ──────┘   └── content ──────┘   └── template ───────────────────────┘
    special ids where the template wrote them; content text is always plain text

Whole-string encoding splits the text at every special token first and encodes each
stretch between two of them on its own; :class:`ChatPromptEncoder` cuts at the same
places, but only where the template wrote the special token, and encodes each stretch
(template text and content together, so pre-tokenization across their seam is
unchanged) with special-token text treated as plain text. For content without
special-token text the ids therefore equal the whole-string encoding.
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from text.chat_template import ChatTemplateError, validate_messages


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered conversation as ``(text, is_content)`` pieces, in order."""

    pieces: tuple[tuple[str, bool], ...]

    @property
    def text(self) -> str:
        """The prompt text, exactly as the template rendered it."""
        return "".join(text for text, _ in self.pieces)

    @property
    def has_content_pieces(self) -> bool:
        """Whether any piece is message content (then special ids come only from the
        template); False: one piece, encoded as a whole string."""
        return any(is_content for _, is_content in self.pieces)


def render_chat_prompt(render: Callable[[list[dict[str, Any]]], str],
                       messages: list[dict[str, Any]],
                       special_tokens: Sequence[str]) -> ChatPrompt:
    """Render ``messages`` with ``render`` into template and content pieces.

    A template that changes content (trims it, splits it, drops a message) cannot be
    split this way: its rendering is then one template piece, which is safe only if no
    content holds special-token text; otherwise ChatTemplateError.
    """
    checked = validate_messages(messages)
    text = render(checked)
    nonce = secrets.token_hex(8)  # unguessable: no content or template can hold a marker
    marked = render([{**m, "content": f"\x00{nonce}:{i}\x00"} if m["content"] else m
                     for i, m in enumerate(checked)])
    parts = re.split(f"\x00{nonce}:(\\d+)\x00", marked)
    # re.split alternates text and captured marker indices: even = template, odd = content
    pieces = tuple((checked[int(part)]["content"], True) if i % 2 else (part, False)
                   for i, part in enumerate(parts) if part)
    prompt = ChatPrompt(pieces)
    if prompt.text == text:
        return prompt
    for index, message in enumerate(checked):
        token = next((s for s in special_tokens if s in message["content"]), None)
        if token is not None:
            raise ChatTemplateError(
                f"messages[{index}].content holds the special token {token[:40]!r}, which "
                f"this model's chat template cannot keep apart from its own")
    return ChatPrompt(((text, False),))


def continue_final(prompt: ChatPrompt, final_content: str) -> ChatPrompt:
    """``prompt`` (rendered without a generation prompt) cut right after the final
    message's content, so the model goes on with that message instead of opening a new
    one (vLLM's ``continue_final_message``): the template's end-of-turn text is dropped.

        <|im_start|>assistant\nOnce upon  ·  <|im_end|>\n   →   <|im_start|>assistant\nOnce upon
                                            └─ cut ──────┘

    The final message's content is the last content piece (templates render messages
    in order); a one-piece rendering is cut after the content's last occurrence (its
    stripped text, for templates that trim). ChatTemplateError when the template does
    not render the content at all or the content is empty.
    """
    if not final_content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with content")
    pieces = prompt.pieces
    last = max((i for i, (_, is_content) in enumerate(pieces) if is_content), default=None)
    if last is not None and pieces[last][0] == final_content:
        return ChatPrompt(pieces[:last + 1])
    text = prompt.text
    needle = final_content if final_content in text else final_content.strip()
    if needle not in text:
        raise ChatTemplateError("continue_final_message: the chat template does not render "
                                "the final message's content, so it cannot be continued")
    return ChatPrompt(((text[:text.rindex(needle) + len(needle)], False),))


class ChatPromptEncoder:
    """Encodes a :class:`ChatPrompt`: special ids only where the template wrote them."""

    def __init__(self, backend: BackendTokenizer):
        self._backend = backend
        # A copy that reads special-token text as plain text (the flag is per tokenizer,
        # so flipping it on the shared one would race with other threads' encodes).
        self._plain = BackendTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self._special_ids = {token.content: index for index, token
                             in backend.get_added_tokens_decoder().items() if token.special}
        # Leftmost-longest, like the tokenizer's own added-token matcher.
        longest_first = sorted(self._special_ids, key=len, reverse=True)
        self._special = (re.compile("|".join(map(re.escape, longest_first)))
                         if longest_first else None)

    @property
    def special_tokens(self) -> list[str]:
        return list(self._special_ids)

    def encode(self, prompt: ChatPrompt) -> list[int]:
        """Token ids of ``prompt`` (no bos/eos added: the template writes its own)."""
        if not prompt.has_content_pieces:  # one template piece: whole-string encoding
            return self._backend.encode_batch([prompt.text], add_special_tokens=False)[0].ids
        stretches, specials = self._split(prompt)
        ids: list[int] = []
        encodings = self._plain.encode_batch(stretches, add_special_tokens=False)
        for encoding, special in zip(encodings, specials + [None]):
            ids += encoding.ids
            if special is not None:
                ids.append(special)
        return ids

    def _split(self, prompt: ChatPrompt) -> tuple[list[str], list[int]]:
        """The stretches between the template's special tokens, and those tokens' ids:
        stretch 0, special 0, stretch 1, ..., special n-1, stretch n."""
        stretches, specials, current = [], [], []
        for text, is_content in prompt.pieces:
            start = 0
            if not is_content and self._special is not None:
                for match in self._special.finditer(text):
                    current.append(text[start:match.start()])
                    stretches.append("".join(current))
                    specials.append(self._special_ids[match.group()])
                    current, start = [], match.end()
            current.append(text[start:])
        stretches.append("".join(current))
        return stretches, specials
