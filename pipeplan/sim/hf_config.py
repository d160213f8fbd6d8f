"""Read a model's shape from a local Hugging Face `config.json` (`[model] config = "path"`).

The file users already have names the shape in transformers' keys; this maps them onto pipeplan's
`[model]` keys, which win when both are given (a scenario giving every size beside a config that differs is
refused: the config would be ignored). The sequence length is the scenario's, else DEFAULT_SEQ_LEN, never
max_position_embeddings; mixture-of-experts configs are refused. LLaMA-family configs (`model_type` llama,
mistral, qwen2) map to architecture "llama"; GPT-2 / GPT-NeoX-free GPT configs (`model_type` gpt2,
megatron-gpt) to "gpt".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeplan.sim.errors import ScenarioError

# transformers key -> pipeplan key, first match wins (GPT-2 uses n_layer/n_embd/n_head/n_inner/n_positions)
_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd"),
    "ffn_hidden": ("intermediate_size", "n_inner"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "vocab": ("vocab_size",),
    "tied_embeddings": ("tie_word_embeddings",),
}
_GPT_TYPES = {"gpt2", "megatron-gpt", "gpt_bigcode", "opt"}
DEFAULT_SEQ_LEN = 4096
"""model.seq_len when neither the scenario nor the command gives one. A config's max_position_embeddings is the
longest sequence the model accepts, not the one it is trained on (Llama-3.1: 131,072, which would need
hundreds of GiB per microbatch); 4,096 is Llama 2's training length and the issue's question."""
_EXPERTS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts", "num_experts_per_tok")
"""Keys naming a mixture of experts (Mixtral, DeepSeek, Qwen-MoE, ...): read as a dense model they would count
the parameters of one expert, about 1/k of the model."""
_SHAPE = ("layers", "hidden", "ffn_hidden", "heads", "vocab")


def shape_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """pipeplan [model] keys read from a transformers config dict (only those it names)."""
    out: dict[str, Any] = {}
    for key, names in _KEYS.items():
        for n in names:
            if cfg.get(n) is not None:
                out[key] = cfg[n]
                break
    model_type = str(cfg.get("model_type", "llama"))
    out["architecture"] = "gpt" if model_type in _GPT_TYPES else "llama"
    if out["architecture"] == "gpt":
        out.setdefault("tied_embeddings", True)  # GPT-2 ties wte and lm_head unless told otherwise
    if model_type in _GPT_TYPES and "ffn_hidden" in out and out["ffn_hidden"] is None:
        del out["ffn_hidden"]
    if isinstance(cfg.get("_name_or_path"), str) and cfg["_name_or_path"]:
        out["name"] = cfg["_name_or_path"].rsplit("/", 1)[-1]
    return out


def merge_hf_config(raw: dict[str, Any], base_dir: Path | None, source: str) -> dict[str, Any]:
    """`raw` with the [model] table's missing keys filled from its `config` file, if it names one."""
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("config"), str):
        return raw
    path = Path(model["config"])
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    from pipeplan.common.io import InputError, read_input_bytes
    from pipeplan.sim.limits import MAX_SCENARIO_BYTES

    try:  # a fifo is refused before it is opened, a huge file before it is read
        cfg = json.loads(read_input_bytes(path, MAX_SCENARIO_BYTES, f"{source}: model.config"))
    except InputError as exc:
        raise ScenarioError(str(exc)) from None
    except ValueError as exc:  # e.g. a 5,000-digit number: int() refuses more than 4,300 digits
        if not isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
            raise ScenarioError(f"{source}: model.config: {path}: a number in it is too long ({str(exc)[:60]})") \
                from None
        raise ScenarioError(f"{source}: model.config: {path} is not a readable JSON file ({exc})") from None
    except RecursionError:
        raise ScenarioError(f"{source}: model.config: {path} is nested too deeply") from None
    except OSError as exc:
        raise ScenarioError(f"{source}: model.config: {path} is not a readable JSON file ({exc})") from None
    if not isinstance(cfg, dict):
        raise ScenarioError(f"{source}: model.config: {path} must hold a JSON object (a config.json)")
    experts = {k: cfg[k] for k in _EXPERTS if isinstance(cfg.get(k), int) and cfg[k] > 1}
    if experts:
        key, count = next(iter(experts.items()))
        raise ScenarioError(f"{source}: model.config: {path.name} is a mixture-of-experts model ({key} = {count}); "
                            "pipeplan models dense decoders only and would count one expert's parameters, so it is "
                            "refused until MoE is modelled")
    shape = shape_from_hf(cfg)
    given = [k for k in _SHAPE if k in model]
    if len(given) == len(_SHAPE) and any(shape.get(k) not in (None, model[k]) for k in given):
        differ = [k for k in given if shape.get(k) not in (None, model[k])]
        raise ScenarioError(f"{source}: model.config: the scenario's [model] gives every size ({', '.join(_SHAPE)}) "
                            f"and its keys win, so {path.name} would be ignored ({differ[0]} = {model[differ[0]]} "
                            f"here, {shape[differ[0]]} there); drop the sizes from [model] to use the config")
    merged = {**shape, **model}
    merged.setdefault("seq_len", DEFAULT_SEQ_LEN)
    return {**raw, "model": merged}
