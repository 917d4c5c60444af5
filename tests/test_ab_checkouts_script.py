"""scripts/ab_checkouts.py: the A/B table's arithmetic and the checkout it runs."""
from __future__ import annotations

import subprocess

import pytest

from helpers import load_script


def test_summary_pairs_each_round_and_keeps_common_measures():
    ab = load_script("ab_checkouts")
    rounds = [{"before": {"decode_step_p50_ms/1": 10.0, "prefill_ttft_p50_ms/prefix": 100.0, "only_before": 1.0},
               "after": {"decode_step_p50_ms/1": 9.0, "prefill_ttft_p50_ms/prefix": 110.0}},
              {"before": {"decode_step_p50_ms/1": 20.0, "prefill_ttft_p50_ms/prefix": 100.0},
               "after": {"decode_step_p50_ms/1": 21.0, "prefill_ttft_p50_ms/prefix": 100.0}},
              {"before": {"decode_step_p50_ms/1": 12.0, "prefill_ttft_p50_ms/prefix": 200.0},
               "after": {"decode_step_p50_ms/1": 12.0, "prefill_ttft_p50_ms/prefix": 180.0}}]
    s = ab.summarize(rounds)
    assert set(s["medians"]["before"]) == {"decode_step_p50_ms/1", "prefill_ttft_p50_ms/prefix"}
    assert s["medians"] == {"before": {"decode_step_p50_ms/1": 12.0, "prefill_ttft_p50_ms/prefix": 100.0},
                            "after": {"decode_step_p50_ms/1": 12.0, "prefill_ttft_p50_ms/prefix": 110.0}}
    # the pairs' ratios, not the medians' ratio: 0.9, 1.05, 1.0 and 1.1, 1.0, 0.9
    assert s["after_over_before_per_round"]["decode_step_p50_ms/1"] == {"median": 1.0, "min": 0.9, "max": 1.05}
    assert s["after_over_before_per_round"]["prefill_ttft_p50_ms/prefix"] == {"median": 1.0, "min": 0.9, "max": 1.1}
    table = ab.markdown("abc", "def", s)
    assert "| decode_step_p50_ms/1 | 12.0 ms | 12.0 ms | 1.00 (0.90-1.05) |" in table
    assert table.splitlines()[0].startswith("| measure | before (abc) | after (def) |")


def test_measures_from_the_scripts_json():
    """Each batch's step, the kernels' share where the profile timed them (a checkout from before the
    timers gives steps only), and the two prefill paths; other paths are left out."""
    ab = load_script("ab_checkouts")
    decode = {"results": [{"batch": 1, "step_p50_ms": 16.5, "kernels_ms": {"attention": 3.8, "linear": 11.0}},
                          {"batch": 64, "step_p50_ms": 170.0}]}
    prefill = {"results": [{"path": p, "ttft_p50_ms": t} for p, t in
                           (("prefix", 170.0), ("no_prefix", 1700.0), ("full", 9.0))]}
    assert ab.measures_from(decode, prefill) == {
        "decode_step_p50_ms/1": 16.5, "decode_attention_ms/1": 3.8, "decode_linear_ms/1": 11.0,
        "decode_step_p50_ms/64": 170.0, "prefill_ttft_p50_ms/prefix": 170.0, "prefill_ttft_p50_ms/no_prefix": 1700.0}


def test_checkout_extracts_a_commit_once(tmp_path):
    ab = load_script("ab_checkouts")
    try:
        head = subprocess.run(["git", "-C", str(ab.REPO), "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    tree = ab.checkout("HEAD", tmp_path)
    assert tree == tmp_path / head[:12]
    assert (tree / "scripts/profile_decode.py").read_text() == subprocess.run(
        ["git", "-C", str(ab.REPO), "show", "HEAD:scripts/profile_decode.py"], check=True, capture_output=True,
        text=True).stdout
    (tree / "marker").write_text("kept")
    assert ab.checkout(head, tmp_path) == tree and (tree / "marker").exists()  # reused, not extracted again
    with pytest.raises(subprocess.CalledProcessError):
        ab.checkout("no-such-revision", tmp_path)
