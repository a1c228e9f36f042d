"""Chat logprobs' ``bytes``: each token's own bytes, so that joined over a reply they
spell the characters no single token holds whole."""
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from text.token_bytes import TokenBytes
from text.tokenizer import Tokenizer

TEXT = "Emoji: 😀 😃, café, 東京, ß and € done"


def test_byte_level_tokens_join_into_the_text(smollm_tokenizer):
    ids = smollm_tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [smollm_tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode()
    # the emoji are split over tokens whose text alone is U+FFFD, but not their bytes
    split = [i for i, p in zip(ids, pieces) if "\ufffd" in smollm_tokenizer.decode([i])]
    assert split and all(b"\xef\xbf\xbd" not in smollm_tokenizer.token_bytes(i) for i in split)


def test_special_tokens_are_their_text(smollm_tokenizer):
    im_end = smollm_tokenizer.backend.token_to_id("<|im_end|>")
    assert smollm_tokenizer.token_bytes(im_end) == b"<|im_end|>"
    assert smollm_tokenizer.token_bytes(10 ** 7) == b""  # a padded logits row


def _sentencepiece_with_byte_fallback() -> BackendTokenizer:
    vocab = {"<unk>": 0, "\u2581": 1, "a": 2, "\u2581a": 3}
    vocab |= {f"<0x{b:02X}>": 4 + b for b in range(256)}
    backend = BackendTokenizer(models.BPE(vocab, [("\u2581", "a")], unk_token="<unk>",
                                          byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    return backend


def test_byte_fallback_pieces_are_their_byte():
    backend = _sentencepiece_with_byte_fallback()
    ids = backend.encode("a €").ids
    assert [backend.id_to_token(i) for i in ids][-3:] == ["<0xE2>", "<0x82>", "<0xAC>"]
    token_bytes = TokenBytes(backend)
    assert b"".join(token_bytes(i) for i in ids) == " a €".encode()  # ▁ is a space
    assert Tokenizer(backend).decode(ids) == "a €"
