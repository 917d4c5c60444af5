"""A token's bytes for chat log-probabilities (server/requests.py TokenTexts.bytes_of): its text's
UTF-8, or, where the token holds part of a character, the bytes its piece spells, for byte-level
BPE and for SentencePiece's byte fallback alike; every token's bytes join into the text."""
from __future__ import annotations

from pathlib import Path

from prefix_service import synthetic
from prefix_service.server.requests import TokenTexts

TEXT = "\U0001F30D caf\u00e9 \u2014 \u00fcn\u00ef, \u4e16\u754c"


def _joined(tokenizer) -> bytes:
    of = TokenTexts().bytes_of(tokenizer)
    return b"".join(of(t) for t in tokenizer.encode(TEXT, add_special_tokens=False))


def test_byte_level_bpe_tokens_give_their_own_bytes(tmp_path: Path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(synthetic.build_tokenizer(tmp_path / "tok"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some token splits a character
    assert _joined(tokenizer) == TEXT.encode()
    texts, of = TokenTexts(), TokenTexts().bytes_of(tokenizer)
    whole = [t for t in range(len(tokenizer)) if "\ufffd" not in texts.of(tokenizer)(t)]
    assert all(of(t) == texts.of(tokenizer)(t).encode() for t in whole)  # the rest: their text's UTF-8


def test_sentencepiece_byte_fallback_tokens_give_their_own_bytes():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", "merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"] + [f"<0x{b:02X}>" for b in range(256)],
                                  show_progress=False)
    tok.train_from_iterator(["the cafe has a table and a menu"] * 50, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    of = TokenTexts().bytes_of(tokenizer)
    for char in ("\U0001F30D", "\u4e16", "\u00e9"):  # not in the vocabulary: spelled in byte pieces
        ids = tokenizer.encode(char, add_special_tokens=False)
        pieces = [t for t in ids if tokenizer.convert_ids_to_tokens(t).startswith("<0x")]
        assert len(pieces) == len(char.encode()) and all(tokenizer.decode([t]) == "\ufffd" for t in pieces)
        assert b"".join(of(t) for t in pieces) == char.encode()
    whole = tokenizer.encode(" cafe", add_special_tokens=False)
    assert [of(t) for t in whole] == [tokenizer.decode([t]).encode() for t in whole]  # the text's UTF-8
