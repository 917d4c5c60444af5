"""Incremental detokenization never emits half a character and loses nothing."""
from transformers import AutoTokenizer

from prefix_service.engine.detokenizer import IncrementalDetokenizer

TEXT = "héllo 東京 😀 naïve café — données 🚀 société ß€"


def test_streamed_text_equals_full_decode_and_never_splits_a_character(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    prompt = tok.encode("the quick brown fox")
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test text must split a character across tokens"
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i)[0] for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens had to wait for the rest of their character
    assert "".join(deltas) + detok.flush() == TEXT


def _until_a_stop(tokenizer_dir, stop: tuple[str, ...]) -> tuple[bool, str]:
    """(whether a stop string was hit, the text emitted) over a fixed sentence, token by token."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    detok = IncrementalDetokenizer(tok, [], stop=stop)
    emitted, hit = "", False
    for i in tok.encode("the quick brown fox jumps over", add_special_tokens=False):
        delta, hit = detok.add(i)
        emitted += delta
        if hit:
            break
    return hit, emitted


def test_stop_string_across_tokens_is_held_back_and_cut(tokenizer_dir):
    hit, emitted = _until_a_stop(tokenizer_dir, ("fox jum",))
    assert hit and emitted == "the quick brown "
    assert "fox" not in emitted


def test_two_stop_strings_completed_by_one_token_cut_at_the_earlier(tokenizer_dir):
    """Both stop strings end on the same character; the text is cut where the first of them begins,
    whatever their order in the request (nothing past a stop reaches the user)."""
    assert _until_a_stop(tokenizer_dir, ("n fox", "brown fox")) == (True, "the quick ")
