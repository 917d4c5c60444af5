"""Incremental detokenization never emits half a character and loses nothing."""
import pytest
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


SENTENCE = "the quick brown fox, the lazy dog and the fox ran."


def test_a_stop_string_is_found_wherever_it_begins_and_ends(tokenizer_dir):
    """Every stop string of 1 to 6 characters taken from a sentence (at its very start, or one that
    the last token completes by its last character alone): the stop is reported and the text
    streamed is the sentence up to the stop string's first occurrence, nothing of it or past it."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    assert tok.decode(ids) == SENTENCE
    assert any(len(tok.decode([i])) == 1 for i in ids), "the sentence must have a one-character token"
    for end in range(1, len(SENTENCE) + 1):
        for length in range(1, min(6, end) + 1):
            stop = SENTENCE[end - length:end]
            detok = IncrementalDetokenizer(tok, [], stop=(stop,))
            emitted, hit = "", False
            for i in ids:
                delta, hit = detok.add(i)
                emitted += delta
                if hit:
                    break
            assert hit and emitted == SENTENCE[:SENTENCE.index(stop)], stop


@pytest.mark.parametrize("stop", [(), ("zzz",), ("zzz", "qqqqqq")])
def test_only_what_may_begin_a_stop_string_is_held_back(tokenizer_dir, stop):
    """After each token the text streamed is all the text so far but its last (longest stop - 1)
    characters (none without stop strings); the end of the request flushes the rest."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    held = max((len(s) for s in stop), default=1) - 1
    detok = IncrementalDetokenizer(tok, [], stop=stop)
    emitted = ""
    for k, i in enumerate(ids, 1):
        delta, hit = detok.add(i)
        assert not hit
        emitted += delta
        so_far = tok.decode(ids[:k])
        assert emitted == so_far[:max(0, len(so_far) - held)]
    assert emitted + detok.flush() == SENTENCE
    assert detok.flush() == ""  # nothing is given twice


def test_the_prompt_gives_the_first_token_its_leading_space():
    """A SentencePiece tokenizer drops the space before the first token of a text it decodes: the
    prompt's last tokens are decoded with the output, so the output's first word keeps its space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", "merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(["the cafe has a table and a menu"] * 50,
                            trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>"], show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    prompt = tokenizer.encode("the cafe has", add_special_tokens=False)
    ids = tokenizer.encode("the cafe has a table", add_special_tokens=False)
    assert ids[:len(prompt)] == prompt and tokenizer.decode(ids[len(prompt):]) == "a table"  # the space dropped
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(detok.add(i)[0] for i in ids[len(prompt):]) + detok.flush() == " a table"
