"""Config loading: YAML validated by the JSON schema, with defaults filled in.

The Snakefile validates with ``snakemake.utils.validate`` against the same schema; this module
gives the CLI (and tests) the same behaviour without Snakemake.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from draftline.hub import RevisionError, hub_revision
from draftline.target import UnsupportedTargetHead, check_teacher_head

SCHEMA_PATH = Path(str(resources.files("draftline") / "schemas" / "config.schema.yaml"))


class ConfigError(ValueError):
    """An invalid config; the message names the offending key."""


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _with_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_DefaultFilling = _with_defaults(jsonschema.Draft202012Validator)


def key_path(error: jsonschema.ValidationError) -> str:
    """Dotted config key of a validation error, e.g. ``generate.temperature``."""
    parts = [f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path]
    path = "".join(parts).lstrip(".")
    if error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        path = ".".join(filter(None, [path, extra[0] if extra else ""]))
    elif error.validator == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        path = ".".join(filter(None, [path, missing[0] if missing else ""]))
    return path or "<root>"


def validate_config(config: dict[str, Any]) -> dict[str, Any]:
    """Validate ``config`` in place and fill defaults; raise ConfigError naming the key."""
    validator = _DefaultFilling(load_schema())
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        raise ConfigError(f"config key '{key_path(err)}': {err.message}")
    check_semantics(config)
    return config


def check_semantics(config: dict[str, Any], base: Path | None = None) -> None:
    """Checks a JSON schema cannot express: files that must exist, cross-key constraints."""
    base = base or Path.cwd()
    for i, src in enumerate(config["prompts"]["sources"]):
        path = src["path"]
        if path == "bundled" or path.startswith("hf:"):
            continue
        if not (base / path).exists():
            raise ConfigError(f"config key 'prompts.sources[{i}].path': file not found: {path}")
    target = config["target"]["model"]
    if target != "toy" and target.startswith(("/", ".")) and not (base / target).exists():
        raise ConfigError(f"config key 'target.model': model directory not found: {target}")
    check_local_target_head(base / target if target != "toy" else None)
    if config["target"]["revision"] is not None:
        try:
            hub_revision(target if target == "toy" else base / target,
                         config["target"]["revision"])
        except RevisionError as exc:
            raise ConfigError(str(exc)) from exc
    toy = config["target"]["toy"]
    if toy["hidden_size"] % toy["num_heads"]:
        raise ConfigError("config key 'target.toy.num_heads': must divide target.toy.hidden_size")
    layer_ids = config["hidden"]["layer_ids"]
    if layer_ids is not None and len(set(layer_ids)) != len(layer_ids):
        raise ConfigError(
            f"config key 'hidden.layer_ids': ids must be distinct, got {layer_ids}")
    if layer_ids is not None and layer_ids != sorted(layer_ids):
        # vLLM feeds the aux states to the draft in layer order, whatever the config says.
        raise ConfigError(f"config key 'hidden.layer_ids': ids must be ascending (vLLM passes "
                          f"the states in layer order), got {layer_ids}")
    if config["server"]["mode"] == "external" and not config["server"]["external"]["base_urls"]:
        raise ConfigError(
            "config key 'server.external.base_urls': required when server.mode is external")
    if config["server"]["launcher"] == "docker" and not config["server"]["image"]:
        raise ConfigError("config key 'server.image': required when server.launcher is docker")


def check_local_target_head(target_dir: Path | None) -> None:
    """A local target whose final head training cannot reproduce is refused now, not at
    hidden-state extraction hours later (a hub id is checked when the stages read it)."""
    config_json = target_dir / "config.json" if target_dir else None
    if config_json is None or not config_json.is_file():
        return
    try:
        check_teacher_head(json.loads(config_json.read_text()), config_json)
    except UnsupportedTargetHead as exc:
        raise ConfigError(f"config key 'target.model': {exc}") from exc


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> dict[str, Any]:
    """Read a YAML config (default ``config/config.yaml``), apply overrides, validate, fill
    defaults."""
    path = Path(path or "config/config.yaml")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    for key, value in (overrides or {}).items():
        _set_dotted(config, key, value)
    return validate_config(config)


def _set_dotted(config: dict, dotted: str, value: Any) -> None:
    node = config
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
