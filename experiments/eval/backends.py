"""Where completions come from: a running specserve service over HTTP, or a unit built in this process.

An `EvalBackend` answers one `CompletionRequest` (a suite's prompt, forced onto one arm, greedy unless the prompt
carries a temperature and seed) with a `Completion`: text, output token count, wall-clock seconds and the
`usage.speculative` object.
- `HTTPBackend(url, model)`: the `openai` client against `{url}/v1`, the arm forced by the `x-specserve-arm`
  header and checked against the response's; reachability is checked when it is made (`GET /v1/models`).
- `InProcessBackend(config)`: one unit built from a config and kept for the whole run (`_build_project_unit`
  is the one function that knows the project's module layout).
Errors: `BackendError` is one failed request (the runner records it and goes on); `BackendUnavailable` means the
service cannot be reached (the runner stops); an unknown arm is a `ValueError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from experiments.eval.suites import EvalPrompt

logger = logging.getLogger(__name__)

ARM_HEADER = "x-specserve-arm"  # = cluster.serving.ab.ARM_HEADER (request) and ARM_RESPONSE_HEADER (response)
PROBE_TIMEOUT_S = 10.0


class BackendError(RuntimeError):
    """One request failed (a server error, a timeout, a prompt the server rejected)."""


class BackendUnavailable(BackendError):
    """The service cannot be reached."""


@dataclass(frozen=True)
class CompletionRequest:
    prompt: EvalPrompt
    arm: str


@dataclass(frozen=True)
class Completion:
    """One answer. `seconds` is the request's wall-clock time; `speculative` is `usage.speculative`."""

    text: str
    output_tokens: int
    seconds: float
    speculative: dict[str, Any] | None
    finish_reason: str | None = None
    served_arm: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.seconds if self.seconds > 0 else None


class EvalBackend(Protocol):
    description: str  # where completions come from, for the run's metadata

    def arm_settings(self) -> dict[str, dict] | None: ...  # {arm: {"verification", "asd"}} when known

    def check_arms(self, arms: Sequence[str]) -> None: ...  # ValueError naming an unknown arm

    def complete(self, request: CompletionRequest) -> Completion: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------------ HTTP


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url: must start with http:// or https://, got {url!r}")
    return url if url.endswith("/v1") else url + "/v1"


class HTTPBackend:
    """A specserve service (or any OpenAI-compatible one that honours the arm header) at `url`."""

    def __init__(self, url: str, model: str | None = None, *, timeout_s: float = 600.0, api_key: str = "unused"):
        import openai

        self._openai = openai
        self.base_url = _base_url(url)
        self.description = f"http {self.base_url}"
        self._client = openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        self.model = model or self._served_model()

    def _served_model(self) -> str:
        try:
            models = self._client.with_options(timeout=PROBE_TIMEOUT_S).models.list()
        except self._openai.APIConnectionError as err:
            raise BackendUnavailable(f"cannot reach a service at {self.base_url}: {err}") from None
        except self._openai.APIStatusError as err:
            raise BackendUnavailable(f"{self.base_url}/models answered HTTP {err.status_code}: {err}") from None
        ids = [m.id for m in models.data]
        if not ids:
            raise BackendUnavailable(f"{self.base_url}/models lists no model")
        return ids[0]

    def arm_settings(self) -> dict[str, dict] | None:
        return None  # the OpenAI API does not expose them; rows still carry usage.speculative

    def default_arms(self) -> list[str]:
        """The service's arms from its export (`GET /v1/specserve/export`), else []."""
        import httpx

        try:
            response = httpx.get(self.base_url.removesuffix("/v1") + "/v1/specserve/export", timeout=PROBE_TIMEOUT_S)
            response.raise_for_status()
            return [str(a) for a in response.json().get("arms", [])]
        except (httpx.HTTPError, ValueError, AttributeError):
            return []

    def check_arms(self, arms: Sequence[str]) -> None:
        """A one-token request per arm: the service rejects an unknown forced arm with a 400."""
        probe = EvalPrompt(prompt="Hello", max_tokens=1)
        for arm in arms:
            try:
                self.complete(CompletionRequest(probe, arm))
            except BackendError as err:
                raise BackendUnavailable(f"the probe request on arm {arm!r} failed: {err}") from None

    def complete(self, request: CompletionRequest) -> Completion:
        openai, prompt = self._openai, request.prompt
        kwargs: dict[str, Any] = dict(model=self.model, max_tokens=prompt.max_tokens,
                                      temperature=prompt.temperature, extra_headers={ARM_HEADER: request.arm})
        if prompt.seed is not None:
            kwargs["seed"] = prompt.seed
        if prompt.stop:
            kwargs["stop"] = list(prompt.stop)
        start = time.perf_counter()
        try:
            if prompt.chat:
                raw = self._client.chat.completions.with_raw_response.create(messages=list(prompt.messages), **kwargs)
            else:
                raw = self._client.completions.with_raw_response.create(prompt=prompt.prompt, **kwargs)
            response = raw.parse()
        except openai.APITimeoutError as err:
            raise BackendError(f"request timed out: {err}") from None
        except openai.APIConnectionError as err:
            raise BackendUnavailable(f"cannot reach a service at {self.base_url}: {err}") from None
        except openai.APIStatusError as err:
            body = err.body if isinstance(err.body, dict) else {}
            if body.get("code") == "unknown_arm" or body.get("param") == ARM_HEADER:
                raise ValueError(f"arm: {body.get('message') or err}") from None
            raise BackendError(f"HTTP {err.status_code}: {body.get('message') or err}") from None
        seconds = time.perf_counter() - start
        served = raw.headers.get(ARM_HEADER)
        if served is not None and served != request.arm:
            raise ValueError(f"arm: asked for {request.arm!r} but {served!r} served the request; is the "
                             f"{ARM_HEADER} header stripped on the way?")
        choice = response.choices[0]
        text = choice.message.content if prompt.chat else choice.text
        usage = response.usage
        speculative = (usage.model_extra or {}).get("speculative") if usage is not None else None
        return Completion(text=text or "", output_tokens=usage.completion_tokens if usage else 0, seconds=seconds,
                          speculative=speculative, finish_reason=choice.finish_reason, served_arm=served)

    def close(self) -> None:
        self._client.close()


# ------------------------------------------------------------------------------------------------ in-process


@dataclass(frozen=True)
class _ProjectUnit:
    """What the runner needs of an in-process unit, whatever the project's layout."""

    arm_settings: dict[str, dict]
    generate: Callable[[EvalPrompt, str], Awaitable[Completion]]  # raises BackendError, ValueError (arm)
    close: Callable[[], Awaitable[None]]
    description: str = field(default="in-process")


def _build_project_unit(config: Any) -> _ProjectUnit:
    """Build one unit in-process from a config (path or parsed). The only code here that imports the project's
    serving modules: when they move, fix the imports in this function."""
    from actors.requests import SamplingParams
    from actors.sources import load_tokenizer
    from cluster.config import SpecServeConfig, load_config, validate_models
    from cluster.serving.ab import ArmRouter
    from cluster.serving.decoder import DecodeJob, Finished, decode_events, local_unit
    from cluster.serving.errors import APIError
    from cluster.serving.protocol import resolve_max_tokens

    if not isinstance(config, SpecServeConfig):
        config = load_config(Path(config))
    validate_models(config)
    tokenizer = load_tokenizer(config.target.source)
    router = ArmRouter(config.arms)
    coordinator = local_unit(config, unit="eval")
    max_seq_len = config.target.max_seq_len or coordinator.max_seq_len
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731

    async def generate(prompt: EvalPrompt, arm: str) -> Completion:
        spec = router.get(arm).to_arm_spec()  # UnknownArmError is a ValueError naming the known arms
        start = time.perf_counter()
        if prompt.chat:
            text = tokenizer.apply_chat_template([dict(m) for m in prompt.messages], tokenize=False,
                                                 add_generation_prompt=True)
            ids = list(tokenizer.encode(text, add_special_tokens=False))
        else:
            ids = list(tokenizer.encode(prompt.prompt))
        try:
            max_tokens = resolve_max_tokens(prompt.max_tokens, prompt_len=len(ids),
                                            default=config.serving.default_max_tokens,
                                            limit=config.serving.max_tokens_limit, max_seq_len=max_seq_len)
        except (APIError, ValueError) as err:
            raise BackendError(f"request rejected: {err}") from None
        params = SamplingParams(max_tokens=max_tokens, temperature=prompt.temperature, seed=prompt.seed)
        job = DecodeJob(f"eval-{uuid.uuid4().hex[:12]}", tuple(ids), params, spec, stop=prompt.stop)
        parts, finished = [], None
        async for event in decode_events(coordinator, job, decode, "eval"):
            parts.append(event.text)
            if isinstance(event, Finished):
                finished = event
        seconds = time.perf_counter() - start
        if finished is None or finished.finish_reason == "error":
            raise BackendError(f"generation failed: {finished.error if finished else 'no result'}")
        return Completion(text="".join(parts), output_tokens=len(finished.token_ids), seconds=seconds,
                          speculative=finished.speculative, finish_reason=finished.finish_reason, served_arm=arm)

    settings = {a.name: {"verification": a.verification, "asd": a.asd.model_dump() if a.asd else None}
                for a in config.arms}
    return _ProjectUnit(settings, generate, coordinator.close, f"in-process {config.name} ({config.target.source})")


class InProcessBackend:
    """One unit built here from a config, used for every request of the run (module docstring)."""

    def __init__(self, config: Any, unit_factory: Callable[[Any], _ProjectUnit] = _build_project_unit):
        self._unit = unit_factory(config)
        self._loop = asyncio.new_event_loop()
        self.description = self._unit.description

    def arm_settings(self) -> dict[str, dict] | None:
        return dict(self._unit.arm_settings)

    def check_arms(self, arms: Sequence[str]) -> None:
        unknown = [a for a in arms if a not in self._unit.arm_settings]
        if unknown:
            raise ValueError(f"arm: unknown {unknown} (the config's arms: {list(self._unit.arm_settings)})")

    def complete(self, request: CompletionRequest) -> Completion:
        return self._loop.run_until_complete(self._unit.generate(request.prompt, request.arm))

    def close(self) -> None:
        """Cancel what an interrupted request left running (Ctrl-C stops `run_until_complete`, not its task),
        then close the unit."""
        if self._loop.is_closed():
            return
        self._loop.run_until_complete(_cancel_other_tasks())
        self._loop.run_until_complete(self._unit.close())
        self._loop.close()


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def with_max_tokens(prompt: EvalPrompt, max_tokens: int | None) -> EvalPrompt:
    """`prompt` with its max_tokens replaced (None keeps the suite's)."""
    return prompt if max_tokens is None else replace(prompt, max_tokens=max_tokens)
