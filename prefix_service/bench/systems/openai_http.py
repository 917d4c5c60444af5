"""One streamed `/v1/completions` call, as vLLM's OpenAI-compatible server and ours both answer it:
server-sent events, each chunk's token ids (`return_token_ids`, vLLM's extension, which ours
takes too) and text, then a usage chunk (`stream_options.include_usage`) and `[DONE]`. The timing
counts tokens as their chunks arrive; the usage is checked against the prompt's tokens and the
tokens that came."""
from __future__ import annotations

import http.client
import json
from typing import Any

from prefix_service.bench.metrics import Timing
from prefix_service.bench.systems import now


def completion_body(model: str, prompt: Any, max_tokens: int, structured_outputs: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """A greedy streamed completion of `prompt` (text or token ids): free text with EOS ignored, or
    an answer under vLLM's `structured_outputs` (ours takes the same field; Answers.structured_outputs)."""
    constraint = {"structured_outputs": structured_outputs} if structured_outputs else {"ignore_eos": True}
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}, **constraint}


def stream_completion(port: int, body: dict[str, Any], prompt_tokens: int, keep_text: bool = False,
                      timeout_s: float | None = None) -> tuple[Timing, bool]:
    """POST body to 127.0.0.1:port/v1/completions and read its stream -> (the timing, whether the
    usage disagreed with prompt_tokens or with the tokens that came). keep_text: the timing keeps
    the answer's text (a constrained workload checks it). A refused call, a broken stream or one
    without its usage is the timing's error."""
    timing = Timing(start=now())
    mismatch = False
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s or 600)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            timing.error = f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}"
            return timing, mismatch
        tokens = 0
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            t = now()
            for choice in chunk.get("choices") or []:
                n = len(choice.get("token_ids") or [])
                timing.add_tokens(n, t, (choice.get("text") or "") if keep_text else "")
                tokens += n
            usage = chunk.get("usage")
            if usage:
                timing.end = t
                mismatch = usage.get("prompt_tokens") != prompt_tokens or usage.get("completion_tokens") != tokens
        conn.close()
        if timing.end is None:
            timing.error = "the stream ended without its usage"
    except (OSError, http.client.HTTPException, ValueError) as e:
        timing.error = f"{type(e).__name__}: {e}"
    return timing, mismatch
