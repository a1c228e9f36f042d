"""The API's tokenizer: text ↔ token ids, special ids, and the model's chat template.

It wraps a ``tokenizers.Tokenizer`` built either from a Hugging Face ``tokenizer.json``
(with ``tokenizer_config.json``, ``chat_template.jinja`` and ``generation_config.json``
beside it when present) or from the vocabulary inside a GGUF file (see gguf_tokenizer.py).
Neither path imports torch or transformers.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Iterable

from tokenizers import Tokenizer as BackendTokenizer

from text.chat_prompt import ChatPrompt, ChatPromptEncoder, continue_final, render_chat_prompt
from text.chat_template import (ChatTemplate, ChatTemplateError, inline_tool_calls,
                                validate_messages)
from text.gguf_tokenizer import build_gguf_tokenizer
from text.token_bytes import TokenBytes
from text.token_span import TokenSpan, token_span
from model_files.gguf_file import GGUFFile
from model_files.paths import ModelFileError, is_gguf_file, resolve_tokenizer_path

CHATML_END_OF_TURN = "<|im_end|>"


class Tokenizer:
    """Encode, decode and chat-format text for one model."""

    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, extra_eos_token_ids: Iterable[int] = (),
                 chat_template: str | None = None):
        self._backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template) if chat_template else None
        self.eos_token_ids = self._collect_eos_ids(extra_eos_token_ids)
        self.all_special_ids = sorted(
            index for index, token in backend.get_added_tokens_decoder().items() if token.special)

    def _collect_eos_ids(self, extra: Iterable[int]) -> tuple[int, ...]:
        # Generation stops at any of these: the eos itself, the model's end-of-turn ids, and
        # ChatML's <|im_end|> when the chat template ends turns with it (a ChatML model
        # whose eos is <|endoftext|> would otherwise run past the end of its answer).
        ids = [self.eos_token_id] if self.eos_token_id is not None else []
        ids += [int(i) for i in extra]
        im_end = self._backend.token_to_id(CHATML_END_OF_TURN)
        if im_end is not None and self.chat_template and CHATML_END_OF_TURN in self.chat_template:
            ids.append(im_end)
        return tuple(dict.fromkeys(ids))

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def token_span(self) -> TokenSpan | None:
        """The most characters one token covers (text/token_span.py); None: no bound."""
        return token_span(self._backend)

    @functools.cached_property
    def _token_bytes(self) -> TokenBytes:
        return TokenBytes(self._backend)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, a partial UTF-8 character included (what chat
        logprobs' ``bytes`` lists; ``decode`` would give U+FFFD), text/token_bytes.py."""
        return self._token_bytes(token_id)

    @functools.cached_property
    def _chat_encoder(self) -> ChatPromptEncoder:
        # Built on first use; two threads racing here build two equal encoders, harmless.
        return ChatPromptEncoder(self._backend)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) map
        to their ids; ``add_special_tokens`` adds bos/eos only where the model asks for it.

        Safe to call from several threads. It goes through ``encode_batch``, which
        releases the GIL while it works; ``encode`` holds it (a thread encoding 1 MiB of
        digits stalled the main thread for the whole 1.8 s; benchmarks/tokenizer_gil.py)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; incomplete UTF-8 at either end decodes to U+FFFD."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: int | Iterable[int]) -> str | list[str] | None:
        """Vocabulary strings of ids (byte-level symbols, e.g. 'Ġworld'); None for unknown ids."""
        if isinstance(token_ids, int):
            return self._backend.id_to_token(token_ids)
        return [self._backend.id_to_token(int(i)) for i in token_ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """Render a conversation into prompt text with the model's chat template.

        Raises ChatTemplateError when the model has no template, the messages are not a list
        of ``{"role", "content"}`` objects, or the template rejects them.
        """
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain completion "
                                    "prompt instead")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, bos_token=self.bos_token,
                                     eos_token=self.eos_token, **template_kwargs)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    split_content: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    continue_final_message: bool = False) -> ChatPrompt:
        """Render a conversation for :meth:`encode_chat`. With ``split_content`` (the
        safe default) special-token text in message content stays plain text; without
        it the whole rendering is encoded as one string (content may write special ids).
        ``tools`` go to templates that render them; a template that does not render
        ``tool_calls`` sees them as the assistant message's content (as plain text).
        ``continue_final_message`` leaves the final message open (its end-of-turn text
        cut off) for the model to go on with; it excludes ``add_generation_prompt``.
        """
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt "
                                        "cannot both be true")
            prompt = self.render_chat(messages, False, split_content, tools)
            return continue_final(prompt, validate_messages(messages)[-1]["content"])
        if self._template is not None and "tool_calls" not in self._template.source:
            messages = inline_tool_calls(messages)

        def render(msgs: list[dict[str, Any]]) -> str:
            return self.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                            tools=tools)

        if not split_content:
            return ChatPrompt(((render(messages), False),))
        return render_chat_prompt(render, messages, self._chat_encoder.special_tokens)

    def encode_chat(self, prompt: ChatPrompt) -> list[int]:
        """Token ids of a rendered conversation (text/chat_prompt.py); thread-safe."""
        return self._chat_encoder.encode(prompt)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer stored in a GGUF file's ``tokenizer.ggml.*`` metadata."""
        parts = build_gguf_tokenizer(GGUFFile(path).metadata)
        return cls(parts.tokenizer, bos_token=parts.bos_token, eos_token=parts.eos_token,
                   extra_eos_token_ids=parts.extra_eos_token_ids,
                   chat_template=parts.chat_template)

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> "Tokenizer":
        """A ``tokenizer.json`` plus the config files next to it (all optional)."""
        path = Path(path)
        folder = path.parent
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        template_file = folder / "chat_template.jinja"
        template = (template_file.read_text() if template_file.is_file()
                    else _pick_template(config.get("chat_template")))
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id", [])
        return cls(BackendTokenizer.from_file(str(path)),
                   bos_token=_token_text(config.get("bos_token", special_map.get("bos_token"))),
                   eos_token=_token_text(config.get("eos_token", special_map.get("eos_token"))),
                   extra_eos_token_ids=generation_eos if isinstance(generation_eos, list)
                   else [generation_eos],
                   chat_template=template)

    @classmethod
    def from_model_path(cls, path: str | Path) -> "Tokenizer":
        """From ``"default"``, a GGUF file, a checkpoint folder or a ``tokenizer.json`` file."""
        resolved = resolve_tokenizer_path(str(path))
        if resolved.is_dir():
            resolved = resolved / "tokenizer.json"
            if not resolved.is_file():
                raise ModelFileError(f"{resolved.parent} has no tokenizer.json; set "
                                     f"model.tokenizer to a folder or file that has one")
        if is_gguf_file(resolved):
            return cls.from_gguf(resolved)
        if resolved.suffix == ".json":
            return cls.from_tokenizer_json(resolved)
        raise ModelFileError(f"{resolved} is neither a GGUF file nor a tokenizer.json")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{path} is not valid JSON: {exc}") from exc


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a token as "<s>" or as {"content": "<s>", ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    # Some configs hold several named templates: [{"name": "default", "template": ...}, ...].
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value
                 if isinstance(entry, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None
