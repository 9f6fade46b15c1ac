"""Task suites: what to ask a model and how to score its answers. A suite is a small plug-in.

A **suite** has a `name`, says whether it is **binary** (every score is pass = 1 or fail = 0, so McNemar's test
applies), lists its **problems**, turns a problem into a **prompt** (chat messages or a plain completion
prompt, with max_tokens and stop strings) and **scores** a completion in [0, 1].

Finding a suite by name (`load_suite`), in this order:
1. `module:object`: `object` in an importable module is a suite, or a callable (class, factory) returning one;
2. the built-in registry (`register_suite` adds to it; the humaneval suites register themselves);
3. the entry point group `specserve.eval_suites`: a package declares
   `[project.entry-points."specserve.eval_suites"] mysuite = "mypkg.suites:MySuite"`.

Scorers must not raise for anything a model writes: a completion that breaks, hangs or crashes scores 0 with a
`detail` saying why. They may be called from several threads at once.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "specserve.eval_suites"
MAX_STOP_STRINGS = 4  # the OpenAI API's limit, which specserve enforces


@dataclass(frozen=True)
class Problem:
    """One task of a suite: a stable `id` (it keys results and pairs arms) and the suite's own `data`."""

    id: str
    data: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class EvalPrompt:
    """One request: chat `messages` ([{"role", "content"}, ...]) or a plain completion `prompt`, exactly one.

    Requests are greedy (temperature 0) so that arms differ only by their verification; `specserve eval
    --temperature T` samples instead, with one `seed` per problem shared by every arm (paired draws).
    """

    messages: tuple[Mapping[str, str], ...] | None = None
    prompt: str | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("EvalPrompt: give exactly one of messages (chat) and prompt (completion)")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature: must be in [0, 2], got {self.temperature}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings, got {list(self.stop)}")

    @property
    def chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class Score:
    """A completion's score in [0, 1]; `passed` is set by binary suites; `detail` says why (e.g. "timeout")."""

    value: float
    passed: bool | None = None
    detail: str = ""

    def __post_init__(self):
        if not 0.0 <= self.value <= 1.0:
            raise ValueError(f"value: a score is in [0, 1], got {self.value}")

    @classmethod
    def of_pass(cls, passed: bool, detail: str = "") -> Score:
        return cls(1.0 if passed else 0.0, passed, detail)


@runtime_checkable
class Suite(Protocol):
    """What a task suite provides (see the module docstring)."""

    name: str
    binary: bool

    def problems(self) -> Sequence[Problem]: ...

    def prompt(self, problem: Problem) -> EvalPrompt: ...

    def score(self, problem: Problem, completion: str) -> Score: ...


_REGISTRY: dict[str, Callable[[], Suite]] = {}
# Built-in suites by `module:object`, imported on first use (so this module imports none of them).
BUILTIN = {
    "humaneval": "experiments.eval.humaneval:HumanEvalSuite",
    "humaneval-chat": "experiments.eval.humaneval:humaneval_chat",
    "humaneval-rewrite": "experiments.eval.humaneval:HumanEvalRewriteSuite",
    "arith": "experiments.eval.synthetic:ArithmeticSuite",
    "lookup": "experiments.eval.synthetic:LookupSuite",
}


def register_suite(name: str, factory: Callable[[], Suite]) -> None:
    """Make `load_suite(name)` return `factory()`. Re-registering a name replaces it."""
    if not name or ":" in name:
        raise ValueError(f"name: a suite name is non-empty and has no ':', got {name!r}")
    _REGISTRY[name] = factory


def _builtin_names() -> list[str]:
    return sorted({*BUILTIN, *_REGISTRY})


def _entry_point_suites() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_suites() -> list[str]:
    """Names `load_suite` resolves without `module:object`."""
    return sorted({*_builtin_names(), *_entry_point_suites()})


def _as_suite(obj: Any, spec: str) -> Suite:
    """`obj` itself when it is a suite instance, else what calling it returns."""
    if not isinstance(obj, type) and isinstance(obj, Suite):
        return obj
    if callable(obj):
        obj = obj()
    if isinstance(obj, type) or not isinstance(obj, Suite):
        raise ValueError(f"suite: {spec!r} is not a suite (needs name, binary, problems(), prompt(), score())")
    return obj


def load_suite(spec: str) -> Suite:
    """The suite named `spec`: `module:object`, a registered name, or an entry point (module docstring)."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"suite: cannot import module {module_name!r} of {spec!r}: {err}") from None
        try:
            obj = getattr(module, attr)
        except AttributeError:
            raise ValueError(f"suite: module {module_name!r} has no {attr!r}") from None
        return _as_suite(obj, spec)
    names = _builtin_names()
    if spec in _REGISTRY:
        return _as_suite(_REGISTRY[spec], spec)
    if spec in BUILTIN:
        return load_suite(BUILTIN[spec])
    plugins = _entry_point_suites()
    if spec in plugins:
        return _as_suite(plugins[spec].load(), spec)
    known = ", ".join(sorted({*names, *plugins}))
    raise ValueError(f"suite: unknown {spec!r} (known: {known}; or module:object for your own)")
