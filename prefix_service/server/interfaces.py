"""What the server drives: an engine client and a template registry, declared once.

The front ends (the gRPC servicers, the OpenAI HTTP API, the metrics endpoint) and PrefixServer
reach the engine and the templates only through these two protocols, held by the Runtime
(runtime.py). Two implementations of each exist, checked against them by the type checker:

| protocol | one process | a fleet on Ray Serve |
| --- | --- | --- |
| `EngineClient` | `Engine` (engine/api.py) | `FleetEngine` (fleet/client.py) |
| `TemplateRegistryClient` | `TemplateRegistry` (templates.py) | `FleetRegistry` (fleet/client.py) |

Each method's docstring is the contract both keep; where the fleet's cannot behave as one process
does, the docstring says how it differs. Importing this module imports neither the engine nor the
fleet (nor torch nor Ray): the types it names are for the type checker.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncGenerator, Protocol

if TYPE_CHECKING:
    import concurrent.futures

    from prefix_service.engine.api import EngineInfo, EngineStatus
    from prefix_service.engine.template_pins import TemplateInfo, TemplateView
    from prefix_service.engine.sequence import GenerateRequest, RequestOutput, ScoreOutput, ScoreRequest
    from prefix_service.server.store import TemplateSource


class EngineClient(Protocol):
    """Generation and the engine's state, as the server calls them. Methods that block (every one
    but generate_stream and drain_aborts) are called from worker threads, never on the event loop.
    Errors are the engine's exceptions (prefix_service.errors, server/status.py); a client that is
    shut down raises EngineStopped."""

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer: the front ends tokenize and render chat messages
        with it (the fleet's front end loads the same one as its replicas)."""

    def generate_stream(self, req: GenerateRequest, executor: concurrent.futures.Executor | None = None
                        ) -> AsyncGenerator[RequestOutput, None]:
        """Yield a RequestOutput per step with new text; the last has finished=True. Raises the
        request's validation error before the first output, or the error that ended it. Closing
        the generator early (or cancelling its task) aborts the request and frees its blocks.

        executor: where the call runs what blocks (the one-process engine's submission and abort,
        which wait on its loop thread); None: the engine's own pool, at its priority. The fleet's
        client has nothing that blocks (its calls to the replicas are awaited on the event loop) and
        does not use it.

        Fleet: the request goes to a replica that holds its template; one whose replica dies under
        it, or that no replica takes in time, ends with ReplicaUnavailable."""
        ...

    async def score_async(self, req: ScoreRequest, executor: concurrent.futures.Executor | None = None
                          ) -> ScoreOutput:
        """Score each candidate continuation after the prompt (engine/scoring.py). Raises the
        validation error, or the error that ended it; cancelling aborts it.

        Fleet: on a replica that holds the template."""
        ...

    async def drain_aborts(self) -> None:
        """Wait for the aborts of streams closed early that are still under way (the server
        calls it once its front ends have drained, before shutdown).

        Fleet: returns at once. Closing a stream cancels its call to the replica right there, and
        the replica aborts the request itself; nothing is left running in this process."""

    def get_template(self, name: str) -> TemplateView:
        """A template's name, token ids and source: a frozen copy, never the engine's live state.
        Raises TemplateNotFound.

        Fleet: from the controller, which keeps every template's token ids."""
        ...

    def list_templates(self) -> list[TemplateInfo]:
        """The registered templates with their counters, in the order they were added.

        Fleet: the controller's view, from the replicas' last reports (at most a poll old); a
        template's counters are summed over the replicas that hold it."""
        ...

    def kv_stats(self) -> dict[str, int]:
        """KV blocks and queue: num_blocks, used, peak_used, free, pinned, running, waiting,
        preemptions, failed_steps, draft_tokens, accepted_draft_tokens, packed_template_bytes.

        Fleet: the replicas' counters summed, as of their last reports (at most a poll old)."""
        ...

    def engine_infos(self) -> dict[str, EngineInfo]:
        """What each engine behind this client runs, by replica id ("" for a one-process engine).

        Fleet: each replica's, from its last report (those that have reported)."""
        ...

    def status(self) -> EngineStatus:
        """kv_stats(), list_templates() and engine_infos() read together (what a metrics scrape reads).

        Fleet: from one call to the controller."""
        ...

    def check_integrity(self) -> None:
        """Raise AssertionError if the engine's block bookkeeping is inconsistent.

        Fleet: every replica checks its own engine; the first failure is raised."""

    def shutdown(self) -> None:
        """Refuse new requests and end the ones in flight with EngineStopped. Any thread; returns
        once the client has stopped.

        Fleet: stops this client only (its streams are cut off, and their replicas abort them);
        the replicas keep running until the server that deployed them tears the fleet down."""


class TemplateRegistryClient(Protocol):
    """The prefix templates as the admin API and the front ends see them: each with its origin
    ("config" for the YAML's, "admin" for those added at run time), the admin ones kept in the
    state file. Every method but `known` blocks (an add prefills the template): the servicers call
    them from worker threads."""

    def add(self, src: TemplateSource) -> TemplateInfo:
        """Tokenize, prefill and pin src, and keep it in the state file when it is an admin
        template. Raises InvalidRequest, the engine's errors (TemplateExists, TemplateBudgetExceeded,
        PromptTooLong, CacheExhausted) or PersistError (the template is then not added).

        Fleet: the controller pins it on the replicas its placement picks, then writes the state
        file (on the head node)."""
        ...

    def remove(self, name: str) -> bool:
        """Unregister a template (and drop an admin one from the state file). True if its blocks
        were freed at once, False if they are freed when the requests using it finish. Raises
        TemplateNotFound or PersistError.

        Fleet: True only when every holder freed them at once."""
        ...

    def listing(self) -> list[tuple[TemplateInfo, str, tuple[str, ...]]]:
        """(info, origin, replica ids) of each template: the replicas that hold it.

        One process: no replica ids (an empty tuple)."""
        ...

    def known(self, name: str) -> bool:
        """Whether a template of this name is registered. Called on the event loop: it must not
        block.

        Fleet: from the routes this client keeps fresh in the background (at most ROUTES_TTL_S
        old)."""
        ...

    async def lookup(self, name: str) -> bool:
        """known(name), asked afresh where known() may be behind: a fleet fetches fresh routes when
        its own do not have the name (a template added a moment ago)."""
        ...

    # last: below it, `list` in the class body would name this method
    def list(self) -> list[tuple[TemplateInfo, str]]:
        """(info, origin) of each template."""
        ...
