"""Config loading: the files layered as Snakemake layers them, validated by the JSON schema,
with defaults filled in.

The Snakefile validates with ``snakemake.utils.validate`` against the same schema; this module
gives the CLI (and tests) the same behaviour without Snakemake.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from draftline.core.config_check import ConfigError, check_semantics
from draftline.core.config_layers import merge, with_target_settings

__all__ = ["ConfigError", "check_semantics", "config_files", "load_config", "load_schema",
           "resolve_section", "validate_config"]

SCHEMA_PATH = Path(str(resources.files("draftline") / "schemas" / "config.schema.yaml"))


# libyaml's safe loader where installed: the schema is large, and every stage's start-up (the
# generate job's included) parses it; the pure-Python parser took 0.3 s of 2 busy cores.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_schema() -> dict:
    return yaml.load(SCHEMA_PATH.read_text(), Loader=_SAFE_LOADER)  # noqa: S506 (a safe loader)


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


def resolve_section(dotted: str, values: dict | None) -> dict[str, Any]:
    """One config section given alone (``train``, ``target.toy``), as a library call made
    without the whole config gets it: a copy with the schema's defaults filled in and the values
    checked, an error naming the key (``config key 'train.lr': ...``). The schema is the only
    place defaults are written."""
    schema = load_schema()
    for part in dotted.split("."):
        schema = schema["properties"][part]
    section = copy.deepcopy(dict(values or {}))
    errors = sorted(_DefaultFilling(schema).iter_errors(section),
                    key=lambda e: list(e.absolute_path))
    if errors:
        inner = key_path(errors[0])
        key = dotted if inner == "<root>" else f"{dotted}.{inner}"
        raise ConfigError(f"config key '{key}': {errors[0].message}")
    return section


# The workflow's default config file, read first as Snakemake's ``configfile:`` reads it (from
# the working directory).
DEFAULT_CONFIG = Path("config/config.yaml")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """One YAML config file as a mapping; an error naming the file otherwise."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return config


def config_files(paths: str | Path | Sequence[str | Path] | None) -> list[Path]:
    """The files a run reads, in order: ``config/config.yaml`` (where the working directory has
    one), then ``paths`` in their order (less that file), as ``snakemake --configfile A B``
    does."""
    files = [DEFAULT_CONFIG] if DEFAULT_CONFIG.is_file() else []
    if paths is None:
        return files
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config file not found: {path}")
        if not (files and path.resolve() == DEFAULT_CONFIG.resolve()):
            files.append(path)
    return files


def load_config(paths: str | Path | Sequence[str | Path] | None = None,
                overrides: dict | None = None) -> dict[str, Any]:
    """The configuration a run uses, resolved as Snakemake resolves it
    (``draftline.core.config_layers``): ``config/config.yaml``, then the files of ``paths``,
    then the dotted ``overrides``, over the target's built-in settings; validated, defaults
    filled."""
    config: dict[str, Any] = {}
    for file in config_files(paths):
        config = merge(config, read_config_file(file))
    for key, value in (overrides or {}).items():
        _set_dotted(config, key, value)
    return validate_config(with_target_settings(config))


def _set_dotted(config: dict, dotted: str, value: Any) -> None:
    node = config
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
