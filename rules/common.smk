# Helpers shared by the rules. Deliberately light: no draftline or heavy imports here, so the
# workflow parses, validates and dry-runs with only Snakemake installed (GPU host orchestrator).
import json
import os
import re
import secrets
import signal
import time
from pathlib import Path


def _sorted_keys(value):
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


# Snakemake compares params by their text, dict order included: with keys sorted, reordering
# a config file (or merging another one) is not mistaken for a change.
_canonical = _sorted_keys(dict(config))
config.clear()
config.update(_canonical)

# What the schema cannot say (files that must exist, rules across keys, a local target's final
# head): the library's own check, the one the CLI runs, before any job.
_library_module("config_check").check_semantics(config)

_layout = _library_module("layout")
# Every path under config["results"] comes from here (draftline.core.layout); a rule names the
# output of another rule as rules.<rule>.output.<name>.
LAYOUT = _layout.Layout.from_config(config)
# The built-in target named by target.model (built by its rule in rules/target.smk), or None.
_builtin_targets = _library_module("builtin_targets")
BUILTIN_TARGET = _builtin_targets.builtin_target(config["target"]["model"])
SHARDS = list(range(config["prompts"]["num_shards"]))
SERVER_STATE = str(LAYOUT.servers)

# The run's API key (draftline.serving.server.RUN_KEY_ENV): the run's shared vLLM servers require it and
# its clients send it. Made once here and inherited by every job of this invocation (a job that
# parses this file again keeps its parent's); never a param, a file or a log line.
os.environ.setdefault("DRAFTLINE_RUN_API_KEY", secrets.token_urlsafe(32))

_codehash = _library_module("codehash")
# parsed imports by file content, kept between runs so that parsing costs nothing once done
_import_cache = _codehash.ImportCache(".snakemake/draftline-imports.json")


def code_hash(script):
    """Content hash of the code a stage runs: scripts/<script>, every draftline module it can
    import (the transitive closure of its imports, read from the source) and the config schema.
    It is passed as a param, so editing any of them makes the stage (and what depends on it)
    stale, and nothing else does."""
    base = WORKFLOW_ROOT
    return _codehash.stage_code_hash(
        base / "scripts" / script,
        base / "src",
        base,
        extra=[base / "src" / "draftline" / "schemas" / "config.schema.yaml"],
        cache=_import_cache,
    )


def target_path(wildcards, input):
    """The target model directory: the built-in target's folder, or the configured model."""
    return input.target if BUILTIN_TARGET else config["target"]["model"]


def hidden_online():
    return config["hidden"]["mode"] == "online"


def train_states_input(wildcards):
    """Offline, training reads the stored states; online, it produces them from the dataset
    (and the hidden_states rule is not in the DAG)."""
    if hidden_online():
        return {"dataset": rules.dataset.output.dataset}
    return {"hidden": rules.hidden_states.output.index}


# hidden keys that only online training reads, and those only extraction reads
_ONLINE_ONLY = ("mode", "online")
_EXTRACT_ONLY = ("samples_per_file", "max_file_bytes", "free_bytes", "disk_margin")


def offline_hidden_params():
    """What extraction reads: the hidden section but its online-only keys."""
    hidden = {k: v for k, v in config["hidden"].items() if k not in _ONLINE_ONLY}
    return {**hidden, "trust_remote_code": config["target"]["trust_remote_code"]}


def online_hidden_params():
    """What online training reads of the hidden section (None offline: no hidden key makes
    an offline training stale, the stored index stands for them)."""
    if not hidden_online():
        return None
    hidden = {k: v for k, v in config["hidden"].items() if k not in _EXTRACT_ONLY}
    return {**hidden, "trust_remote_code": config["target"]["trust_remote_code"]}


def answer_sampling():
    """How the dataset's answers were sampled (generate's temperature and top_p): what the
    hidden-state gate checks the captured final states against."""
    return {k: config["generate"][k] for k in ("temperature", "top_p")}


def online_sampling_params():
    """The gate's sampling for online training (None offline: extraction gated the states)."""
    return answer_sampling() if hidden_online() else None


def online_server_params():
    """What the vllm producer of online training reads of the server section (its own
    server's settings; None for the hf producer or offline, which start no server)."""
    if not hidden_online() or config["hidden"]["backend"] != "vllm":
        return None
    skip = ("mode", "external", "reasoning_parser")
    return {k: v for k, v in config["server"].items() if k not in skip}


def target_input():
    """A built-in target is an artifact of this workflow (its rule's output); a given one is not."""
    return getattr(rules, BUILTIN_TARGET.rule).output.target if BUILTIN_TARGET else []


# Draft variants (train.variants): trained, exported, benchmarked and bundled beside the
# main draft, each in results/variants/{variant}/.
_variants = _library_module("variants")
VARIANTS = _variants.variant_names(config["train"])


wildcard_constraints:
    variant="|".join(map(re.escape, VARIANTS)) or "no-variant",


def main_train_params():
    """train without its variants: adding a variant leaves the main draft's training valid."""
    return _variants.main_train(config["train"])


def variant_train_params(wildcards):
    return _variants.variant_train(config["train"], wildcards.variant)


def variant_files(path):
    """``path`` (a Layout.variant_* method) of every variant."""
    return [str(path(name)) for name in VARIANTS]


_hub = _library_module("hub")


def compare_draft_files():
    """The files of bench.compare_drafts (config and weights), so a changed draft makes the
    benchmark stale; a hub id's are in its cached snapshot (none without huggingface_hub).
    """
    files = []
    for draft in config["bench"]["compare_drafts"]:
        try:
            folder = _hub.local_dir(draft["model"], draft["revision"])
        except ImportError:
            continue
        files += sorted(
            str(p)
            for p in Path(folder).iterdir()
            if p.name == "config.json" or p.suffix == ".safetensors"
        )
    return files


def package_data(name):
    """A data file shipped with the library (an input, so editing it makes its stage stale).

    Named relative to the working directory: Snakemake records a job's input paths as written
    and replans every job whose recorded set differs, so an absolute path would make a finished
    run stale in full once its folder is moved or copied elsewhere."""
    return os.path.relpath(WORKFLOW_ROOT / "src" / "draftline" / "data" / name)


def prompt_source_files():
    """Local prompt files (the bundled set included), so edits to them make shards stale."""
    bundled = package_data("prompts.jsonl")
    paths = [
        s["path"]
        for s in config["prompts"]["sources"]
        if not s["path"].startswith("hf:")
    ]
    return [bundled if p == "bundled" else p for p in paths]


def profile_input():
    """generate.concurrency: auto reads the measured profile; an integer needs none."""
    return (
        rules.concurrency_profile.output.json
        if config["generate"]["concurrency"] == "auto"
        else []
    )


def config_keys(section, keys):
    """Only ``keys`` of a config section: a rule's params hold exactly the values it reads, so
    changing another key of the section does not rerun it."""
    return {k: config[section][k] for k in keys}


def sampling_params():
    keys = ("temperature", "top_p", "max_tokens", "seed", "chat_template_kwargs")
    return config_keys("generate", keys)


def bench_generate_params():
    """What the benchmark takes from generation: its sampling (with the benchmark's own
    max_tokens) and, for the levels when bench.levels is null, its concurrency."""
    keys = ("concurrency", "temperature", "top_p", "seed", "chat_template_kwargs")
    return config_keys("generate", keys)


def hidden_engine_params():
    """The server settings the hidden-state engine reads (draftline.stages.hidden.vllm_backend);
    none with the hf backend, which starts no vLLM."""
    if config["hidden"]["backend"] != "vllm":
        return None
    keys = (
        "tensor_parallel_size",
        "max_model_len",
        "max_num_seqs",
        "dtype",
        "enforce_eager",
        "gpu_memory_utilization",
        "cpu_kvcache_space_gib",
        "extra_args",
        "env",
    )
    return config_keys("server", keys)


def server_params():
    """Everything that defines the served target (part of the workload fingerprint)."""
    return {
        "server": config["server"],
        "trust_remote_code": config["target"]["trust_remote_code"],
    }


def profile_outputs():
    """The concurrency profile and its plot, when this run measures one (concurrency: auto)."""
    if config["generate"]["concurrency"] != "auto":
        return []
    return rules.concurrency_profile.output


def bench_outputs():
    """The deployment benchmark's files for the bundle (results, summary, plots); none while
    the workflow has no rule named bench (include rules/bench.smk before rules/bundle.smk).
    """
    return rules.bench.output if rules.has("bench") else []


def bundle_config():
    """The config the bundle records: all of it but the publishing destination (where a bundle
    is copied to must neither change its bytes nor make it stale)."""
    cfg = json.loads(json.dumps(config))
    cfg["bundle"].pop("publish_to", None)
    return cfg


def publish_target(name):
    """A published file (name: tar, manifest or sha256) under bundle.publish_to: a Snakemake
    storage target for a URL (s3://, gs://, ...; needs that storage plugin), else a local path.
    """
    dest = config["bundle"]["publish_to"]
    path = _layout.published_files(dest)[name]
    return storage(path) if "://" in dest else path


def final_outputs():
    outputs = [rules.bundle.output.tar, rules.generation_summary.output.json]
    if config["bundle"]["publish_to"]:
        outputs += rules.publish_bundle.output
    if config["bundle"]["hf_repo"]:
        outputs += rules.push_bundle_to_hub.output
    return outputs


def serving_container():
    """Image of the rules that run vLLM: containers.serving, else the pipeline image."""
    return config["containers"]["serving"] or config["containers"]["pipeline"]


def stop_shared_servers(wait_s=60):
    """Stop the run's shared vLLM servers now instead of after their idle timeout, and wait
    (bounded) until their supervisors have taken the servers down."""
    pids = []
    for state_path in Path(SERVER_STATE).glob("*.json"):
        try:
            pid = json.loads(state_path.read_text()).get("supervisor_pid")
            if pid:
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(0.2)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
