"""The `prefix-service` command: run the server, call it, manage its prefix templates."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any, Callable, Sequence

from prefix_service import envs

ADDRESS_ENV = "PREFIX_SERVICE_ADDRESS"
TOKEN_ENV = "PREFIX_SERVICE_ADMIN_TOKEN"
TLS_CA_ENV = "PREFIX_SERVICE_TLS_CA"

EPILOG = """\
examples:
  # serve the default config (SmolLM2-135M-Instruct and two templates)
  prefix-service prepare-model
  prefix-service serve --config configs/default.yaml

  # generate, continuing a pinned template (only the prompt is prefilled)
  prefix-service generate --template intent_classifier --max-tokens 8 $'Message: "I was charged twice"\\nIntent:'
  prefix-service generate --template table_qa --max-tokens 48 $'Q: Which flight to Newark was cancelled?\\nA:'
  # chat: the prompt becomes a user message rendered with the model's chat template
  prefix-service generate --chat 'What is the capital of France?'

  # what a running server computes with; what this machine would serve a config with
  prefix-service info
  prefix-service env --config configs/default.yaml

  # manage templates at run time (persisted across restarts)
  prefix-service template add faq --file faq.md
  prefix-service template add support_bot --system-prompt 'You are a polite support agent.'
  prefix-service template list
  prefix-service template remove faq

  # template KV snapshots, offline (no server): check them, move them between machines
  prefix-service snapshot verify --config configs/default.yaml
  prefix-service snapshot export faq faq.kv.safetensors --config configs/default.yaml
  prefix-service snapshot import faq.kv.safetensors --config configs/default.yaml

environment:
  PREFIX_SERVICE_ADDRESS      default --address (127.0.0.1:50051)
  PREFIX_SERVICE_ADMIN_TOKEN  default --token for the template commands; the server reads its
                              token from the variable named by server.admin_token_env
  PREFIX_SERVICE_TLS_CA       default --tls-ca (a server with server.tls_cert_file set)
"""


def _default_address() -> str:
    return envs.value(ADDRESS_ENV) or "127.0.0.1:50051"


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=_default_address(),
                   help=f"server host:port (default: ${ADDRESS_ENV} or 127.0.0.1:50051)")


def _add_tls(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls", action="store_true", help="connect with TLS, checking the server's certificate "
                   "against the system's trusted roots (implied by --tls-ca)")
    p.add_argument("--tls-ca", metavar="PEM", default=envs.value(TLS_CA_ENV),
                   help=f"connect with TLS, trusting this CA (or self-signed) certificate (default: ${TLS_CA_ENV})")


def _token(text: str) -> str:
    """An argparse type: the admin token as the server reads its own (surrounding whitespace
    dropped), which must be printable ASCII to travel in a gRPC header."""
    token = text.strip()
    if not (token.isascii() and token.isprintable()):
        raise argparse.ArgumentTypeError("a token is printable ASCII (letters, digits, punctuation)")
    return token


def _add_token(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", type=_token, default=envs.value(TOKEN_ENV),
                   help=f"admin token, sent as 'authorization: Bearer <token>' (default: ${TOKEN_ENV})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefix-service", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="LLM generation with operator-named, pinned KV-cache prefixes: long shared prompt "
                    "prefixes are prefilled once at startup and every request continues one of them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the server (gRPC and the OpenAI HTTP API)",
                       description="Load the model, pin every template of the config, serve gRPC and the OpenAI HTTP "
                                   "API until SIGTERM/SIGINT (then drain for server.grace_period_s).")
    p.add_argument("--config", required=True, metavar="FILE", help="YAML service config, e.g. configs/default.yaml")
    p.add_argument("--address", help="override server.address (host:port; port 0 picks a free one)")
    p.add_argument("--http-address", metavar="ADDRESS",
                   help="override server.http_address, the OpenAI-compatible HTTP API ('' turns it off)")
    p.add_argument("--ray", action="store_true",
                   help="serve as a fleet of engine replicas on Ray Serve (the config's ray section, or its "
                        "defaults; needs pip install 'prefix-service[ray]'; docs/scale-out.md)")
    p.add_argument("--replicas", type=int, metavar="N", help="override ray.num_replicas (implies --ray)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    p = sub.add_parser("env", help="what this machine would serve a config with: CPU, dtype, backend, kernels",
                       description="Report the CPU and its instruction sets, the software, the dtype and backend "
                                   "the config's model gets here and why, each kernel choice of the cpu backend "
                                   "(building its libraries if they are not built yet) and the PREFIX_SERVICE_* "
                                   "variables set; no weights are loaded. Exits 1 when a probe fails.")
    p.add_argument("--config", metavar="FILE", help="YAML service config (default: none, the machine's part only)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")

    p = sub.add_parser("generate", help="stream a completion to stdout (usage to stderr)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  prefix-service generate --template table_qa --max-tokens 32 'Q: ...\\nA:'\n"
                              "  echo 'Tell me a joke' | prefix-service generate --chat -\n"
                              "  prefix-service generate --template intent_classifier --text "
                              "'Message: \"Hi\"\\nIntent:'\n"
                              "  prefix-service generate --template table_qa --json-schema @answer.schema.json "
                              "'Q: ...\\nA:'\n")
    p.add_argument("prompt", metavar="PROMPT", help="text continuing the template ('-' reads stdin)")
    p.add_argument("--template", "--prefix", dest="template", metavar="NAME",
                   help="pinned template to continue (default: none; --prefix is another name for it)")
    p.add_argument("--chat", action="store_true",
                   help="send PROMPT as a user message through the model's chat template")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before PROMPT")
    p.add_argument("--max-tokens", type=_integer(0, 2**32 - 1), default=0, metavar="N",
                   help="default: the server's configured default")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=0.0, metavar="P", help="0 (default) means 1.0")
    p.add_argument("--top-k", type=_integer(-1, 2**31 - 1), default=0, metavar="K",
                   help="0 (default) or -1 means no limit")
    p.add_argument("--seed", type=_integer(0, 2**64 - 1), default=None, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], metavar="S", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="deadline for the whole call")
    g = p.add_argument_group("structured output (one of; default: the template's own output, if it has one)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--choice", action="append", metavar="TEXT",
                     help="the output is exactly one of these (repeatable: --choice ' yes' --choice ' no')")
    one.add_argument("--json-schema", metavar="SCHEMA", help="a JSON schema the output conforms to (JSON, or @FILE)")
    one.add_argument("--json-object", action="store_true", help="any JSON object")
    one.add_argument("--regex", metavar="RE", help="the output matches this regular expression, whole")
    one.add_argument("--grammar", metavar="LARK", help="a Lark grammar (or @FILE)")
    one.add_argument("--text", action="store_true", help="free text, even on a template with an output of its own")
    _add_address(p)
    _add_tls(p)

    p = sub.add_parser("info", help="what a running server computes with: model, context, dtype, backend",
                       description="Ask a running server (GetServerInfo) for its model, the longest request it "
                                   "takes, and each engine's dtype, KV cache, backend and instruction sets (one "
                                   "per replica in a fleet).")
    p.add_argument("--json", action="store_true", help="the answer as JSON")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="deadline (default 10)")
    _add_address(p)
    _add_tls(p)

    p = sub.add_parser("template", aliases=["prefix"],
                       help="add, list or remove templates (admin API of a running server; alias: prefix)")
    psub = p.add_subparsers(dest="template_command", required=True, metavar="ACTION")
    a = psub.add_parser("add", help="prefill and pin a template (persisted across restarts)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="examples:\n  prefix-service template add faq --file faq.md\n"
                               "  prefix-service template add bot --system-prompt 'You are terse.'\n")
    a.add_argument("name", metavar="NAME")
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", metavar="F", help="raw text from this file")
    src.add_argument("--content", metavar="TEXT", help="raw text")
    src.add_argument("--system-prompt", metavar="TEXT",
                     help="a system message rendered with the model's chat template (for --chat requests)")
    lst = psub.add_parser("list", help="list the pinned templates")
    lst.add_argument("--json", action="store_true", help="one JSON object per template")
    rm = psub.add_parser("remove", help="unregister a template (blocks freed when its requests finish)")
    rm.add_argument("name", metavar="NAME")
    for q, deadline in ((a, 600.0), (lst, 30.0), (rm, 30.0)):  # an add prefills its template first
        q.add_argument("--timeout", type=float, default=deadline, metavar="SECONDS",
                       help=f"deadline (default {deadline:g})")
        _add_address(q)
        _add_tls(q)
        _add_token(q)

    from prefix_service.snapshot_cli import add_parser as add_snapshot_parser
    add_snapshot_parser(sub)

    sub.add_parser("prepare-model", add_help=False,
                   help="convert the bundled SmolLM2-135M-Instruct into a model directory (once)")
    sub.add_parser("bench", add_help=False,  # options: prefix_service/bench/main.py
                   help="benchmark named templates vs none, transformers, vLLM and the gRPC server")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prepare-model"]:
        from prefix_service.prepare_model import main as prepare_main
        return prepare_main(argv[1:])
    if argv[:1] == ["bench"]:
        from prefix_service.bench.main import main as bench_main
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "env":
        from prefix_service.env_report import main as env_main
        return env_main(args.config, args.json)
    if args.command == "snapshot":  # offline: files and a config, no server
        from prefix_service.snapshot_cli import main as snapshot_main
        return snapshot_main(args)
    import grpc
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "info":
            return _info(args)
        return _template(args)
    except grpc.RpcError as e:
        code = e.code()
        hint = ""
        if code == grpc.StatusCode.UNAVAILABLE and "connect" in (e.details() or "").lower():
            hint = f"\n(is a server running at {args.address}? start one with: prefix-service serve --config FILE)"
        print(f"error: {code.name}: {e.details()}{hint}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. an unreadable --tls-ca file
        print(f"error: {e}", file=sys.stderr)
        return 2
    except UnicodeEncodeError as e:  # an argument or stdin that is not UTF-8 (its bytes kept as surrogates)
        byte = e.object[e.start:e.end].encode("utf-8", "surrogateescape")
        print(f"error: the text given is not UTF-8 (a byte {byte!r} at character {e.start})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _integer(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (what the request's field holds), else the usual
    `error: argument ...` and exit 2 rather than a traceback when the request is built."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from prefix_service.config import load_config
    from prefix_service.errors import PrefixServiceError
    from prefix_service.server import serve

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        envs.check()  # a mistyped kernel setting stops here, not after the model has loaded
        if chosen := envs.set_values():
            logging.getLogger("prefix_service.envs").info(
                "kernel settings from the environment: %s", envs.listed(chosen))
        config = load_config(args.config)
        if args.address:
            config = dataclasses.replace(config, server=dataclasses.replace(config.server, address=args.address))
        if args.http_address is not None:
            config = dataclasses.replace(config, server=dataclasses.replace(config.server,
                                                                            http_address=args.http_address))
        if args.ray or args.replicas is not None:
            from prefix_service.config import RayConfig
            ray = config.ray or RayConfig()
            if args.replicas is not None:
                ray = dataclasses.replace(ray, num_replicas=args.replicas, min_replicas=None, max_replicas=None)
            config = dataclasses.replace(config, ray=ray)
        if config.ray is not None:
            from prefix_service.fleet import use_serve_env
            for key, value in use_serve_env().items():
                logging.getLogger("prefix_service.fleet").info("Ray Serve setting from the environment: %s=%s",
                                                               key, value)
            try:
                from prefix_service.fleet.launcher import fleet_server  # ray loads only for a fleet
            except ImportError as e:
                print(f"error: serving a fleet (the config's ray section, or --ray) needs Ray Serve: "
                      f"pip install 'prefix-service[ray]' ({e})", file=sys.stderr)
                return 2
            asyncio.run(serve(config, fleet_server))
        else:
            asyncio.run(serve(config))
    except (PrefixServiceError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _generate(args: argparse.Namespace) -> int:
    from prefix_service.client import PrefixServiceClient
    from prefix_service.proto import prefix_service_pb2 as pb

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    messages = None
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        prompt = ""
    elif args.system:
        print("error: --system needs --chat", file=sys.stderr)
        return 2
    try:
        structured_output = _structured_output(args)
    except _Unreadable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    last = None
    with PrefixServiceClient(args.address, tls=args.tls, tls_ca_file=args.tls_ca) as client:
        for msg in client.generate(prompt, args.template, messages=messages, max_tokens=args.max_tokens,
                                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                   seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                                   structured_output=structured_output, timeout=args.timeout):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            last = msg
    sys.stdout.write("\n")
    if last is not None:
        u = last.usage
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(f"[{reason}] prompt {u.prompt_tokens} tokens ({u.prefix_tokens} reused from the template), "
              f"{u.completion_tokens} completion tokens, ttft {u.ttft_ms:.0f} ms", file=sys.stderr)
    return 0


class _Unreadable(Exception):
    """A flag's @FILE that cannot be read."""


def _structured_output(args: argparse.Namespace) -> dict[str, Any] | None:
    """The structured output the flags ask for (client.structured_output_message's form), None for
    none; a value starting with @ is read from that file (_Unreadable when it cannot be). The server
    checks the constraint itself (INVALID_ARGUMENT naming it)."""
    def text(value: str) -> str:
        if not value.startswith("@"):
            return value
        try:
            with open(value[1:], encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:  # a file that is not UTF-8 text too
            raise _Unreadable(f"cannot read {value[1:]}: {e}") from None

    if args.choice:
        return {"choice": args.choice}
    if args.json_schema is not None:
        return {"json_schema": text(args.json_schema)}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.grammar is not None:
        return {"grammar": text(args.grammar)}
    if args.json_object:
        return {"json_object": True}
    if args.text:
        return {"text": True}
    return None


def _info(args: argparse.Namespace) -> int:
    from prefix_service.client import PrefixServiceClient

    with PrefixServiceClient(args.address, tls=args.tls, tls_ca_file=args.tls_ca) as client:
        info = client.server_info(timeout=args.timeout)
    if args.json:  # every field, defaults too, under its proto name

        def fields(msg: Any) -> dict[str, Any]:
            return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}
        print(json.dumps({**fields(info), "engines": [fields(e) for e in info.engines]}, indent=2))
        return 0
    print(f"prefix_service {info.version} at {args.address}: model {info.model}, max_model_len {info.max_model_len}")
    for e in info.engines:
        where = f"replica {e.replica}" if e.replica else "engine"
        isa = f", {e.cpu_isa}" + (f" (kernels built for -march={e.cpu_march})" if e.cpu_march else "") \
            if e.cpu_isa else ""
        print(f"{where}: {e.dtype} on {e.device}{isa}; KV cache {e.kv_cache_dtype}, {e.num_blocks} blocks of "
              f"{e.block_size}; quantization {e.quantization}{', batch-invariant' if e.batch_invariant else ''}")
        print(f"  backend {e.backend_description}")
    return 0


def _template(args: argparse.Namespace) -> int:
    from prefix_service.client import PrefixServiceClient

    with PrefixServiceClient(args.address, token=args.token, tls=args.tls, tls_ca_file=args.tls_ca) as client:
        if args.template_command == "add":
            content = args.content
            if args.file:
                try:
                    with open(args.file, encoding="utf-8") as f:
                        content = f.read()
                except (OSError, UnicodeDecodeError) as e:  # a file that is not UTF-8 text too
                    print(f"error: cannot read {args.file}: {e}", file=sys.stderr)
                    return 2
            t = client.add_template(args.name, content, system_prompt=args.system_prompt, timeout=args.timeout)
            print(f"added {t.name}: {t.num_tokens} tokens, {t.num_blocks} blocks pinned")
        elif args.template_command == "list":
            templates = client.list_templates(timeout=args.timeout)
            if args.json:
                for t in templates:
                    print(json.dumps({"name": t.name, "num_tokens": t.num_tokens, "num_blocks": t.num_blocks,
                                      "requests_served": t.requests_served, "active_requests": t.active_requests,
                                      "origin": t.origin, "kind": t.kind, "kv_source": t.kv_source,
                                      "replicas": list(t.replicas)}))
            else:
                fleet = any(t.replicas for t in templates)  # a fleet says where each template is pinned
                rows = [("NAME", "TOKENS", "BLOCKS", "SERVED", "ACTIVE", "ORIGIN", "KIND", "KV") +
                        (("REPLICAS",) if fleet else ())] + [
                    (t.name, str(t.num_tokens), str(t.num_blocks), str(t.requests_served), str(t.active_requests),
                     t.origin, t.kind, t.kv_source or "-") + ((",".join(t.replicas) or "-",) if fleet else ())
                    for t in templates]
                widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
                for r in rows:
                    print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        else:
            resp = client.remove_template(args.name, timeout=args.timeout)
            print(f"removed {args.name}" + (" (its blocks are freed when the requests using it finish)"
                                             if resp.deferred else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
