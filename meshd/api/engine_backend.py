"""The engine behind the API: ``EngineSource`` adapts ``engine.scheduler.Scheduler`` to ``TokenSource``.

``load_engine_backend(spec_text, state_dir, max_active)`` loads a ``PATH`` or ``tiny`` SPEC (model,
tokenizer, scheduler) and returns a ``GenBackend``; ``close()`` on the source stops the scheduler thread.
Prompts: chat requests go through the model's chat template, completions through ``encode``; a prompt
that does not fit, or a bad template, is a 400 before anything is generated.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from meshd.api.backends import BackendBusy, GenBackend, GenToken
from meshd.api.errors import ApiError
from meshd.api.schema import GenRequest
from meshd.api.tools import request_grammar, tool_format_of

log = structlog.get_logger(__name__)


def experts_unavailable(model: str, reason: str) -> ApiError:
    """The 503 for a model whose routed experts have no live worker, before or during generation."""
    return ApiError(503, f"model '{model}' cannot be served now: {reason}", code="experts_unavailable",
                    retry_after_s=5)


class _EngineRun:
    def __init__(self, handle: Any, tokenizer: Any, name: str) -> None:
        self.handle = handle
        self.tokenizer = tokenizer
        self.name = name

    def cancel(self) -> None:
        self.handle.cancel()

    def _piece(self, token_id: int) -> str:
        try:
            return str(self.tokenizer.decode([token_id], skip_special_tokens=False))
        except Exception:  # noqa: BLE001 - a display string only
            return ""

    async def __aiter__(self) -> AsyncIterator[GenToken]:
        from engine.constraint import GrammarError
        from engine.experts.coordinator import ExpertsUnavailable
        from engine.pipeline.client import PipelineUnavailable

        async for ev in self.handle:
            if ev.finish_reason == "error":
                if isinstance(ev.exception, GrammarError):  # a schema llguidance checks but cannot build
                    raise ApiError(400, f"cannot enforce the requested format: {ev.exception}",
                                   code="unsupported_schema")
                if isinstance(ev.exception, ExpertsUnavailable):  # workers went away mid-generation
                    raise experts_unavailable(self.name, str(ev.exception))
                if isinstance(ev.exception, PipelineUnavailable):  # stages went away, none left to re-plan on
                    raise ApiError(503, f"model '{self.name}' cannot be served now: {ev.exception}",
                                   code="pipeline_unavailable", retry_after_s=5)
                raise RuntimeError(ev.error or "engine error")
            if ev.token_id is None:
                if ev.finish_reason == "cancelled":
                    return
                continue
            top = [(self._piece(t), float(lp)) for t, lp in ev.top_logprobs]
            finish = ev.finish_reason if ev.finish_reason in ("stop", "length") else None
            yield GenToken(ev.token_id, ev.text, ev.logprob, top, finish, self._piece(ev.token_id))
            if ev.finish_reason is not None:
                return


class EngineSource:
    """``TokenSource`` over one Scheduler."""

    def __init__(self, name: str, model: Any, tokenizer: Any, scheduler: Any, fingerprint: str,
                 executor: Any = None) -> None:
        self.name = name
        self.executor = executor
        self.model = model
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.fingerprint = fingerprint
        self.tool_format = tool_format_of(getattr(tokenizer, "chat_template_source", None))

    def prompt_ids(self, req: GenRequest) -> list[int]:
        from engine.tokenizer import ChatTemplateError

        try:
            if req.kind == "chat":
                tools = [t.openai() for t in req.tools] if req.tools_active else None
                ids = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tools=tools,
                                                         release_gil=True)
            elif isinstance(req.prompt, list):
                ids = list(req.prompt)
            else:
                ids = self.tokenizer.encode(req.prompt, release_gil=True)
        except ChatTemplateError as e:
            raise ApiError(400, f"cannot build the prompt: {e}", code="chat_template_error") from None
        return list(ids)

    def _params(self, ids: list[int], req: GenRequest) -> Any:
        from engine.generate import context_length
        from engine.sampling import SamplingParams

        n_ctx = context_length(self.model) or 4096
        max_tokens = req.max_tokens if req.max_tokens is not None else max(1, n_ctx - len(ids))
        seed = req.seed % (2**63) if req.seed is not None else None
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if isinstance(vocab, int):
            for tok in req.logit_bias:
                if tok >= vocab:
                    raise ApiError(400, f"'logit_bias' names token id {tok}; the model's vocabulary has {vocab} ids",
                                   code="invalid_value", param="logit_bias")
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=seed,
                              stop=tuple(req.stop), top_logprobs=req.top_logprobs if req.logprobs else 0,
                              top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                              frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                              logit_bias=tuple(sorted(req.logit_bias.items())), ignore_eos=req.ignore_eos,
                              grammar=request_grammar(req, self.tool_format, self.tokenizer))

    def submit(self, prompt_ids: list[int], req: GenRequest) -> _EngineRun:
        from engine.scheduler import Busy, SchedulerClosed

        reason = self.executor.unavailable_reason() if self.executor is not None else None
        if reason:  # --remote-experts on and some routed expert has no live worker
            raise experts_unavailable(self.name, reason)
        params = self._params(prompt_ids, req)
        try:
            handle = self.scheduler.submit(prompt_ids, params, loop=asyncio.get_running_loop())
        except Busy:
            raise BackendBusy() from None
        except SchedulerClosed:
            raise ApiError(503, f"model '{self.name}' is shutting down on this node") from None
        except ValueError as e:
            raise ApiError(400, str(e), code="invalid_request") from None
        return _EngineRun(handle, self.tokenizer, self.name)

    def in_flight(self) -> int:
        return int(self.scheduler.active)

    def capacity(self) -> int:
        return int(self.scheduler.max_active)

    def close(self) -> None:
        self.scheduler.close()


class PipelineSource(EngineSource):
    """``EngineSource`` over a pipelined model: 503 naming what is missing while no plan can serve it."""

    def __init__(self, *args: Any, serving: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.serving = serving

    def submit(self, prompt_ids: list[int], req: GenRequest) -> _EngineRun:
        reason = self.serving.unavailable_reason()
        if reason:  # --pipeline on and the stage nodes cannot hold the model now
            raise ApiError(503, f"model '{self.name}' cannot be served now: {reason}", code="pipeline_unavailable",
                           retry_after_s=5)
        return super().submit(prompt_ids, req)


class EngineBackend(GenBackend):
    """A ``GenBackend`` whose ``stop()`` closes the scheduler."""

    async def stop(self) -> None:
        src = self.source
        if isinstance(src, EngineSource):
            await asyncio.to_thread(src.close)


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint loaded for serving: its served name, directory, model, tokenizer and fingerprint (the
    16 hex digits of ``engine.fingerprint``, the same with or without ``--pipeline``)."""

    name: str
    path: Path
    model: Any
    tokenizer: Any
    fingerprint: str


def load_engine_model(spec_text: str, state_dir: str | Path, remote_experts: bool = False) -> LoadedModel:
    """Load a ``PATH``/``tiny`` SPEC (blocking; call in a thread). Raises ``UsageError`` for a bad SPEC
    or checkpoint. With ``remote_experts`` the routed experts are neither read ahead nor widened here:
    workers compute them, so this node touches their pages only for a ``prefer`` fallback."""
    from engine.fingerprint import fingerprint, short
    from engine.model import Model
    from engine.spec import parse_model_spec, resolve_checkpoint
    from engine.tokenizer import Tokenizer
    from meshd.errors import UsageError

    try:
        spec = parse_model_spec(spec_text)
        path = resolve_checkpoint(spec, state_dir)
        if remote_experts:
            model = Model.load(path, widen_experts=False, prefetch=False)
        else:
            model = Model.load(path)
        tokenizer = Tokenizer.load(path)
        fp = short(fingerprint(path, cache_dir=state_dir))  # cached in the state dir across restarts
    except (ValueError, OSError) as e:
        raise UsageError(f"--model {spec_text}: {e}") from None
    except Exception as e:  # noqa: BLE001 - checkpoint/config/tokenizer errors of the engine
        raise UsageError(f"--model {spec_text}: {e}") from None
    return LoadedModel(spec.name or path.name, path, model, tokenizer, fp)


def engine_backend(loaded: LoadedModel, max_active: int | None = None, executor: Any = None) -> EngineBackend:
    """Start a scheduler for ``loaded``; ``executor`` (an ``engine.moe`` expert executor, e.g. the experts
    service's ``RemoteExecutor``) computes the routed experts instead of this process."""
    from engine.scheduler import DEFAULT_MAX_ACTIVE, Scheduler

    sched = Scheduler(loaded.model, loaded.tokenizer, max_active or DEFAULT_MAX_ACTIVE, name=loaded.name,
                      executor=executor)
    log.info("engine_model_loaded", model=loaded.name, path=str(loaded.path), remote_experts=executor is not None)
    return EngineBackend(EngineSource(loaded.name, loaded.model, loaded.tokenizer, sched,
                                      loaded.fingerprint, executor=executor))


def load_engine_backend(spec_text: str, state_dir: str | Path, max_active: int | None = None) -> EngineBackend:
    """Load a ``PATH``/``tiny`` SPEC with local experts. Raises ``UsageError`` for a bad SPEC or checkpoint."""
    return engine_backend(load_engine_model(spec_text, state_dir), max_active)
