"""Reading a config: YAML → validated `SpecServeConfig`, errors that name the field's path and line, and the
checks that need the models' own config files (`validate_models`). `load_config` is the only YAML parser in
the project; everything else receives the validated object (or `dump_config`'s JSON-able dict of it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.config.schema import SpecServeConfig


class ConfigError(ValueError):
    """A config that fails validation; the message names the source and the path of each bad field."""


def parse_config(data: Any, source: str = "<config>", text: str | None = None) -> SpecServeConfig:
    """Validate a parsed mapping (from YAML, or serveConfigV2's inline args) into a `SpecServeConfig`.

    `text`, when given, is the YAML it came from, so errors can cite line numbers.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping, got {type(data).__name__}")
    try:
        return SpecServeConfig.model_validate(data)
    except ValidationError as err:
        lines = _yaml_lines(text) if text is not None else {}
        problems = []
        for e in err.errors():
            path = dotted_path(e["loc"])
            where = _nearest_line(lines, e["loc"])
            problems.append(f"  {path or '<root>'}{f' (line {where})' if where else ''}: {e['msg']}")
        raise ConfigError(f"{source}: invalid config\n" + "\n".join(problems)) from None


def load_config(path: str | Path, *, check_engines: bool = True) -> SpecServeConfig:
    """Read and validate a YAML config file; errors name the file and the YAML path of each bad field.

    `check_engines`: a config whose engine is 'vllm' fails here, naming the extra to install, when vLLM is
    not importable (`actors.engines.vllm.require_vllm`). Rendering manifests for a cluster
    (`cluster.k8s`) passes False: the image has the engine, the machine that renders need not."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    cfg = parse_config(data, source=str(path), text=text)
    if check_engines:
        engines_available(cfg, source=str(path))
    return cfg


def engines_available(cfg: SpecServeConfig, source: str = "<config>") -> None:
    """ConfigError naming the extra to install when the config's engine is not installed here."""
    if cfg.target.engine == "vllm" or cfg.drafter.engine == "vllm":
        from actors.engines.vllm import require_vllm

        try:
            require_vllm()
        except ImportError as err:
            raise ConfigError(f"{source}: target.engine is 'vllm' but {err}") from None


def dump_config(cfg: SpecServeConfig) -> dict[str, Any]:
    """The config as a JSON-able dict; `parse_config(dump_config(cfg)) == cfg`."""
    return cfg.model_dump(mode="json")


def validate_models(cfg: SpecServeConfig, model_info: Callable[[str], dict] | None = None) -> None:
    """Checks that need the models' own configs; ValueError naming the config field.

    - target.tensor_parallel_size divides the target's attention heads and KV heads;
    - a model drafter's vocabulary equals the target's (draft ids are scored by the target), and so does a
      draft model's with drafter kind 'vllm';
    - an EAGLE head's hidden size equals the target's (it reads the target's hidden states);
    - with drafter.method 'medusa', drafter.source is a Medusa head of the target's hidden and vocabulary sizes,
      with at least gamma.gamma_max heads;
    - with drafter.method 'mtp', the target declares MTP layers (`num_nextn_predict_layers` or
      `mtp_num_hidden_layers` in its config);
    - target.max_seq_len fits the target's position embeddings.

    `model_info(source)` returns a dict with vocab_size, hidden_size, num_attention_heads, num_key_value_heads,
    max_position_embeddings, mtp_layers (default: `actors.sources.model_info`, which reads only the model's config).
    """
    if model_info is None:
        from actors.sources import model_info
    target = model_info(cfg.target.source)
    tp = cfg.target.tensor_parallel_size
    for key in ("num_attention_heads", "num_key_value_heads"):
        if target[key] % tp:
            raise ValueError(
                f"target.tensor_parallel_size ({tp}) must divide the target's {key} ({target[key]})"
            )
    limit = target.get("max_position_embeddings")
    if cfg.target.max_seq_len is not None and limit and cfg.target.max_seq_len > limit:
        raise ValueError(f"target.max_seq_len ({cfg.target.max_seq_len}) exceeds the target's "
                         f"max_position_embeddings ({limit})")
    method = cfg.drafter.method if cfg.drafter.kind == "vllm" else None
    if cfg.drafter.kind == "model" or method == "draft_model":
        drafter = model_info(cfg.drafter.source)
        if drafter["vocab_size"] != target["vocab_size"]:
            raise ValueError(f"drafter.source vocab_size ({drafter['vocab_size']}) must equal the target's "
                             f"({target['vocab_size']})")
    if method == "eagle":
        head = model_info(cfg.drafter.source)
        if head["hidden_size"] != target["hidden_size"]:
            raise ValueError(f"drafter.source hidden_size ({head['hidden_size']}) must equal the target's "
                             f"({target['hidden_size']}): an EAGLE head reads the target's hidden states")
    if method == "medusa":
        head = model_info(cfg.drafter.source)
        if head.get("model_type") != "medusa":
            raise ValueError(f"drafter.source ({cfg.drafter.source}) is not a Medusa head (config.json model_type "
                             f"{head.get('model_type')!r}, not 'medusa')")
        for key in ("hidden_size", "vocab_size"):
            if head[key] is not None and head[key] != target[key]:
                raise ValueError(f"drafter.source {key} ({head[key]}) must equal the target's ({target[key]}): Medusa "
                                 "heads read the target's hidden states and draft its token ids")
        if (head["num_heads"] or 0) < cfg.gamma.gamma_max:
            raise ValueError(f"drafter.source has {head['num_heads']} Medusa heads, fewer than gamma.gamma_max "
                             f"({cfg.gamma.gamma_max}): each head drafts one position, so γ can reach only as many")
    if method == "mtp" and not target.get("mtp_layers"):
        raise ValueError(f"drafter.method 'mtp' drafts with the target's own MTP layers, and target.source "
                         f"({cfg.target.source}) declares none (no num_nextn_predict_layers or mtp_num_hidden_layers "
                         "in its config)")


def dotted_path(loc: tuple) -> str:
    """('arms', 1, 'asd', 'g') -> 'arms[1].asd.g'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _yaml_lines(text: str) -> dict[tuple, int]:
    """Map each YAML path (keys and list indices) to its 1-based line number."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    lines: dict[tuple, int] = {}

    def walk(node, path: tuple) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                lines[path + (key.value,)] = key.start_mark.line + 1  # a field's line is its key's
                walk(value, path + (key.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    if root is not None:
        walk(root, ())
    return lines


def _nearest_line(lines: dict[tuple, int], loc: tuple) -> int | None:
    """Line of the deepest existing prefix of `loc` (a missing field points at its parent)."""
    for cut in range(len(loc), 0, -1):
        if loc[:cut] in lines:
            return lines[loc[:cut]]
    return None
