"""What a config's JSON schema cannot say: files that must exist, rules across keys.

The one semantic check of a config, after the schema has filled the defaults:
``draftline.core.config`` runs it for the CLI and the tests, and ``rules/common.smk`` runs it at
Snakefile parse time, before any job. Standard library only, with its siblings ``hub``,
``target``, ``builtin_targets`` and ``variants`` (which are too) and, for a variant's draft
keys, jsonschema and PyYAML (Snakemake's own dependencies), and ``draftline.drafts.registry``
for the draft families' checks (standard library only, it too): the workflow loads this file
by its path, where the draftline package may not be installed (an orchestrator with Snakemake
only), and then loads its siblings and the registry the same way.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any


def _by_path(name: str, folder: str = "core"):
    path = Path(__file__).parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_draftline_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __package__ == "draftline.core":
    from draftline.core import builtin_targets, hub, secret_names, variants
    from draftline.core import target as target_module
else:  # loaded by its path (rules/common.smk): its siblings are loaded by theirs
    hub, target_module = _by_path("hub"), _by_path("target")
    builtin_targets = _by_path("builtin_targets")
    secret_names = _by_path("secret_names")
    variants = _by_path("variants")
# The draft families' facts and checks, by path either way: an import would put every family's
# torch modules (the registry names them) in the code of each stage that checks a config
# (draftline.core.codehash), and a change to a draft's model would redo the target and data.
registry = _by_path("registry", "drafts")

SCHEMA_PATH = Path(__file__).parents[1] / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    """An invalid config; the message names the offending key."""


def check_semantics(config: dict[str, Any], base: Path | None = None) -> None:
    """Checks a JSON schema cannot express: files that must exist, cross-key constraints.
    Relative paths are read from ``base`` (the working directory by default)."""
    base = base or Path.cwd()
    for i, src in enumerate(config["prompts"]["sources"]):
        path = src["path"]
        if path == "bundled" or path.startswith("hf:"):
            continue
        if not (base / path).exists():
            raise ConfigError(f"config key 'prompts.sources[{i}].path': file not found: {path}")
    target = config["target"]["model"]
    builtin = builtin_targets.is_builtin(target)
    if not builtin and target.startswith(("/", ".")) and not (base / target).exists():
        raise ConfigError(f"config key 'target.model': model directory not found: {target}")
    check_local_target_head(None if builtin else base / target)
    _check_variants(config)
    _check_draft_families(config, base)
    _check_revision(config, base)
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
    _check_online_producer(config)
    if config["server"]["mode"] == "external" and not config["server"]["external"]["base_urls"]:
        raise ConfigError(
            "config key 'server.external.base_urls': required when server.mode is external")
    if config["server"]["launcher"] == "docker" and not config["server"]["image"]:
        raise ConfigError("config key 'server.image': required when server.launcher is docker")
    _check_no_literal_secrets(config["server"])
    _check_bind_has_key(config["server"])
    _check_compare_drafts(config["bench"]["compare_drafts"], base)
    _check_probabilistic_has_a_temperature(config)


def _check_probabilistic_has_a_temperature(config: dict) -> None:
    bench = config["bench"]
    temperatures = bench["temperatures"]
    if temperatures is None:
        temperatures = [0.0, config["generate"]["temperature"]]
    if "probabilistic" in bench["draft_sample_methods"] and not any(t > 0 for t in temperatures):
        raise ConfigError(
            "config key 'bench.draft_sample_methods': probabilistic drafting differs from greedy "
            f"only at T > 0, and bench.temperatures ({bench['temperatures']}, with "
            f"generate.temperature {config['generate']['temperature']}) has none: add one")


def _check_compare_drafts(drafts: list[dict], base: Path) -> None:
    """Distinct names, and each draft on this machine (a folder, or a hub id in the cache)."""
    names = [d["name"] for d in drafts]
    for name in {n for n in names if names.count(n) > 1}:
        raise ConfigError(f"config key 'bench.compare_drafts': the name {name!r} is used twice")
    for i, draft in enumerate(drafts):
        model = draft["model"]
        local = base / model if model.startswith(("/", ".")) else model
        try:
            folder = hub.local_dir(local, draft.get("revision"))
        except ImportError:  # a hub id on an orchestrator without huggingface_hub: the job checks
            continue
        except FileNotFoundError as exc:
            raise ConfigError(str(exc).replace("'target.model'",
                                               f"'bench.compare_drafts[{i}].model'")) from exc
        if not (Path(folder) / "config.json").is_file():
            raise ConfigError(f"config key 'bench.compare_drafts[{i}].model': {model} has no "
                              "config.json: not a draft checkpoint")


def _check_no_literal_secrets(server: dict) -> None:
    """Secrets reach a server only by the name of an environment variable: a value in the config
    would be copied into the server's spec file, the rules' params and the logs."""
    for name, value in server["env"].items():
        if secret_names.secret_variable_name(name) and secret_names.looks_like_secret(value):
            raise ConfigError(
                f"config key 'server.env.{name}': looks like a secret written into the config; "
                f"pass it by name: set {name} in the run's environment and list it in "
                "server.pass_env")
    for arg in server["extra_args"]:
        option = secret_names.secret_option(arg)
        if option:
            instead = "server.api_key_env" if option == "--api-key" else "server.pass_env"
            raise ConfigError(
                f"config key 'server.extra_args': {option} would put a secret in the config; "
                f"pass it by name through {instead}")


LOOPBACK_HOSTS = ("localhost", "::1")


def _loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def _check_bind_has_key(server: dict) -> None:
    """A server reachable from other hosts must require a key its clients are given: the run's
    own random key is known to the run's processes only."""
    docker_key = (server.get("docker") or {}).get("api_key_env")
    has_key = server.get("api_key_env") or (server["launcher"] == "docker" and docker_key)
    if not _loopback(server["host"]) and not has_key:
        raise ConfigError(
            f"config key 'server.host': {server['host']} is not a loopback address, and a server "
            "reachable from other hosts needs an API key: set server.api_key_env to the NAME of "
            "an environment variable holding it (or bind 127.0.0.1)")


def _check_online_producer(config: dict) -> None:
    """hidden.online's server keys: an external producer needs its spool folder; a managed one
    runs as a process (a container would write the spool where the trainer cannot see it)."""
    hidden, online = config["hidden"], config["hidden"].get("online") or {}
    if online.get("external_url") and not online.get("spool_dir"):
        raise ConfigError("config key 'hidden.online.spool_dir': required with "
                          "hidden.online.external_url (the server's spool folder, as the "
                          "training job sees it)")
    if online.get("spool_dir") and not online.get("external_url"):
        raise ConfigError("config key 'hidden.online.spool_dir': only for an external producer "
                          "(hidden.online.external_url); a managed one keeps its spool in the "
                          "run's server folder")
    if (hidden["mode"] == "online" and hidden["backend"] == "vllm"
            and not online.get("external_url") and config["server"]["launcher"] == "docker"):
        raise ConfigError("config key 'server.launcher': the vllm producer of hidden.mode online "
                          "starts its server as a process (launcher docker does not mount its "
                          "spool folder yet); use launcher process or hidden.online.external_url")

def _check_revision(config: dict, base: Path) -> None:
    """A revision pins a hub id; a built-in target or a local directory has none."""
    target, revision = config["target"]["model"], config["target"]["revision"]
    if revision is None:
        return
    if builtin_targets.is_builtin(target):
        raise ConfigError(
            f"config key 'target.revision' is {revision!r}, but target.model ({target}) is a "
            "built-in target, built into <results>/target, which has no revisions: set "
            "target.revision to null")
    try:
        hub.hub_revision(base / target, revision)
    except hub.RevisionError as exc:
        raise ConfigError(str(exc)) from exc


def _target_mla(config: dict, base: Path) -> bool | None:
    """Whether the target has MLA attention, where it is known now: a built-in target (a
    Llama, none has) or a local folder's config.json; None for a hub id (read when the stages
    load it)."""
    target = config["target"]["model"]
    if builtin_targets.is_builtin(target):
        return False
    config_json = base / target / "config.json"
    if not config_json.is_file():
        return None
    return target_module.uses_mla(target_module.text_config(json.loads(config_json.read_text())))


def _check_draft_families(config: dict, base: Path) -> None:
    """What each draft's family (``draftline.drafts.registry``) says vLLM cannot serve: the
    train.draft and every variant's, beside this target."""
    problem = registry.config_problems(config, variants.drafts(config["train"]),
                                       _target_mla(config, base))
    if problem:
        raise ConfigError(problem)


def _check_variants(config: dict) -> None:
    """train.variants: names no benchmark configuration or further draft takes, and draft
    keys that train.draft has, with values its schema allows, that change something."""
    train = config["train"]
    names = variants.variant_names(train)
    further = {d["name"] for d in config["bench"]["compare_drafts"]}
    for i, name in enumerate(names):
        key = f"train.variants[{i}]"
        if name in names[:i]:
            raise ConfigError(f"config key '{key}.name': the name {name!r} is used twice")
        if name in variants.RESERVED_NAMES or name in further:
            raise ConfigError(f"config key '{key}.name': {name!r} is taken (by the benchmark's "
                              "own configurations or by bench.compare_drafts)")
        changes = train["variants"][i]["draft"]
        for draft_key in changes:
            if draft_key not in train["draft"]:
                raise ConfigError(f"config key '{key}.draft.{draft_key}': not a train.draft key "
                                  f"(one of {', '.join(sorted(train['draft']))})")
        if all(train["draft"][k] == v for k, v in changes.items()):
            raise ConfigError(f"config key '{key}.draft': changes nothing in train.draft, so it "
                              "would train the main draft again")
        _check_draft_values(f"{key}.draft", changes)


def _check_draft_values(key: str, changes: dict) -> None:
    """A variant's draft keys against train.draft's schema (jsonschema and PyYAML come with
    Snakemake, so the workflow has them at parse time as the CLI does)."""
    import jsonschema
    import yaml

    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    draft_schema = schema["properties"]["train"]["properties"]["draft"]["properties"]
    for name, value in changes.items():
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(draft_schema[name]).iter_errors(value))
        if error is not None:
            raise ConfigError(f"config key '{key}.{name}': {error.message}")


def check_local_target_head(target_dir: Path | None) -> None:
    """A local target whose final head training cannot reproduce is refused now, not at
    hidden-state extraction hours later (a hub id is checked when the stages read it)."""
    config_json = target_dir / "config.json" if target_dir else None
    if config_json is None or not config_json.is_file():
        return
    try:
        target_module.check_teacher_head(json.loads(config_json.read_text()), config_json)
    except target_module.UnsupportedTargetHead as exc:
        raise ConfigError(f"config key 'target.model': {exc}") from exc
