"""Proto messages <-> engine types. Proto3 defaults carry meaning here: temperature 0 is greedy,
top_p 0 means 1.0, top_k 0 means no limit, max_tokens 0 means the configured default, an unset
seed means random, repetition_penalty 0 means 1.0, an unset logprobs means none, n 0 means 1, an
unset structured_output means the template's default output (or free text)."""
from __future__ import annotations

import os
from typing import Callable, Iterable, Sequence

from prefix_service.errors import InvalidRequest
from prefix_service.engine.api import EngineInfo, least_max_model_len
from prefix_service.engine.template_pins import TemplateInfo
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.sampling_params import SamplingParams, StructuredOutput
from prefix_service.engine.sequence import FinishReason, RequestOutput, ScoreOutput
from prefix_service.server.requests import RequestSpec
from prefix_service.versions import package_version

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def sampling_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Range checks are the engine's (SamplingParams.validate); only defaults are filled here."""
    return SamplingParams(
        max_tokens=p.max_tokens or None,
        temperature=float(p.temperature),
        top_p=float(p.top_p) if p.top_p != 0 else 1.0,
        top_k=int(p.top_k),
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(int(t) for t in p.stop_token_ids),
        ignore_eos=bool(p.ignore_eos),
        logprobs=int(p.logprobs) if p.HasField("logprobs") else None,
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        repetition_penalty=float(p.repetition_penalty) if p.repetition_penalty != 0 else 1.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in p.logit_bias.items())),
        min_tokens=int(p.min_tokens),
        n=int(p.n) or 1,
        structured=structured_from_proto(p.structured_output, "sampling.structured_output")
        if p.HasField("structured_output") else None,
    )


def structured_from_proto(msg: pb.StructuredOutput, param: str) -> StructuredOutput | None:
    """None when no kind is set (an empty message)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    where = f"{param}.{kind}"
    if kind in ("json_object", "text"):
        if not getattr(msg, kind):
            raise InvalidRequest(f"{where}: set it true, or leave the field unset", param=where)
        return StructuredOutput(kind, param=where)
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(msg.choice.choices), param=where)
    return StructuredOutput(kind, getattr(msg, kind), param=where)


def structured_to_proto(spec: StructuredOutput | None) -> pb.StructuredOutput | None:
    if spec is None:
        return None
    msg = pb.StructuredOutput()
    if spec.kind == "choice":
        msg.choice.choices.extend(spec.choices)
    else:  # json_object and text are set true; the rest carry their text
        setattr(msg, spec.kind, True if spec.kind in ("json_object", "text") else spec.spec)
    return msg


def spec_from_proto(request: pb.GenerateRequest) -> RequestSpec:
    return RequestSpec(prefix_name=request.prefix_name or None, prompt=request.prompt or None,
                       messages=messages_from_proto(request.messages) or None,
                       sampling=sampling_from_proto(request.sampling), request_id=request.request_id or None)


def messages_from_proto(messages: Iterable[pb.ChatMessage]) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(messages):
        if not m.role:
            raise InvalidRequest(f"messages[{i}].role is empty; use system, user or assistant",
                                 param=f"messages[{i}].role")
        out.append({"role": m.role, "content": m.content})
    return out


def output_to_proto(out: RequestOutput, token_text: Callable[[int], str] | None = None) -> pb.GenerateResponse:
    """token_text: a token id's text for the log-probabilities (when the request asked for them)."""
    msg = pb.GenerateResponse(text=out.text, token_ids=out.token_ids, request_id=out.request_id, index=out.index)
    text = token_text or (lambda token: "")
    for lp in out.logprobs or ():
        msg.logprobs.append(pb.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, token=text(lp.token_id),
            top=[pb.TopLogprob(token_id=t, logprob=v, token=text(t)) for t, v in lp.top]))
    if out.finished:
        assert out.finish_reason is not None  # the last output has its reason
        msg.finish_reason = _FINISH[out.finish_reason]
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=out.prompt_tokens, prefix_tokens=out.cached_tokens,
                                    completion_tokens=out.completion_tokens, ttft_ms=out.ttft_ms or 0.0))
    return msg


def score_to_proto(out: ScoreOutput, candidates: Sequence[str]) -> pb.ScoreResponse:
    return pb.ScoreResponse(
        candidates=[pb.CandidateScore(candidate=text, logprob=c.logprob, token_ids=c.token_ids,
                                      token_logprobs=c.token_logprobs) for text, c in zip(candidates, out.candidates)],
        usage=pb.Usage(prompt_tokens=out.prompt_tokens, prefix_tokens=out.cached_tokens), request_id=out.request_id)


def server_info_to_proto(served_name: str, infos: dict[str, EngineInfo]) -> pb.ServerInfo:
    """GetServerInfo's answer: the served model's id, the engines' least context, and each engine
    (infos: replica id, "" for a server in one process, -> its EngineInfo), in replica order."""
    engines = [pb.EngineDescription(
        replica=replica, model=os.path.basename(os.path.normpath(info.model_path)), dtype=info.dtype,
        kv_cache_dtype=info.kv_cache_dtype, device=info.device, backend=info.backend,
        backend_description=info.backend_description, max_model_len=info.max_model_len,
        block_size=info.block_size, num_blocks=info.num_blocks, quantization=info.quantization,
        batch_invariant=info.batch_invariant, cpu_isa=info.cpu_isa, cpu_march=info.cpu_march)
        for replica, info in sorted(infos.items())]
    return pb.ServerInfo(version=package_version(), model=served_name, engines=engines,
                         max_model_len=least_max_model_len(infos.values()) or 0)


def template_to_proto(info: TemplateInfo, origin: str, replicas: Sequence[str] = ()) -> pb.PrefixTemplate:
    return pb.PrefixTemplate(
        name=info.name, num_tokens=info.num_tokens, num_blocks=info.num_blocks,
        requests_served=info.requests_served, active_requests=info.active_requests, origin=origin,
        kind="system_prompt" if "system_prompt" in info.source else "content", replicas=replicas,
        structured_output=structured_to_proto(info.structured), kv_source=info.kv_source)
