"""Config validation: defaults filled, and every bad config is stopped naming its key."""

import json
import re
import shutil
import subprocess
import sys
from collections import Counter

import pytest
import yaml
from conftest import REPO

from draftline.cli import build_parser
from draftline.core.builtin_targets import BUILTIN_TARGETS
from draftline.core.config import ConfigError, load_config, validate_config
from draftline.core.config_layers import target_settings

BAD_CONFIGS = [
    ({"generate": {"temperature": "hot"}}, "generate.temperature"),
    ({"generate": {"temperature": 5}}, "generate.temperature"),
    ({"generate": {"concurrency": 0}}, "generate.concurrency"),
    ({"generate": {"concurrency": "max"}}, "generate.concurrency"),
    ({"generate": {"temprature": 0.5}}, "generate.temprature"),
    ({"bogus_section": {}}, "bogus_section"),
    ({"prompts": {"num_shards": 0}}, "prompts.num_shards"),
    ({"prompts": {"sources": [{"path": "does/not/exist.jsonl"}]}}, "prompts.sources[0].path"),
    ({"prompts": {"sources": [{"split": "train"}]}}, "prompts.sources[0].path"),
    ({"server": {"mode": "remote"}}, "server.mode"),
    ({"server": {"port": 80}}, "server.port"),
    ({"server": {"mode": "external"}}, "server.external.base_urls"),
    ({"server": {"external": {"base_urls": ["ftp://x"]}}}, "server.external.base_urls[0]"),
    ({"target": {"toy": {"num_layers": 4}}}, "target.toy.num_layers"),
    ({"target": {"toy": {"num_heads": 3}}}, "target.toy.num_heads"),
    ({"hidden": {"layer_ids": [2, 2, 5]}}, "hidden.layer_ids"),
    ({"hidden": {"layer_ids": [2, 5]}}, "hidden.layer_ids"),
    ({"hidden": {"layer_ids": [30, 2, 16]}}, "hidden.layer_ids"),
    ({"hidden": {"backend": "jax"}}, "hidden.backend"),
    ({"train": {"ttt_steps": 0}}, "train.ttt_steps"),
    ({"train": {"lr": -1}}, "train.lr"),
    ({"dataset": {"eval_fraction": 0.9}}, "dataset.eval_fraction"),
    ({"profile": {"levels": []}}, "profile.levels"),
    ({"profile": {"tolerance": 2}}, "profile.tolerance"),
    ({"bench": {"num_speculative_tokens": [0]}}, "bench.num_speculative_tokens[0]"),
    ({"bench": {"repetitions": 0}}, "bench.repetitions"),
    ({"train": {"batch_tokens": -5}}, "train.batch_tokens"),
    ({"vocab": {"draft_vocab_size": "big"}}, "vocab.draft_vocab_size"),
    ({"results": 7}, "results"),
]


def test_defaults_are_filled():
    config = validate_config({})
    assert config["results"] == "results"
    assert config["generate"]["concurrency"] == "auto"
    assert config["profile"]["levels"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert config["server"]["host"] == "127.0.0.1"
    assert config["train"]["ttt_steps"] == 7


def test_shipped_config_is_valid():
    config = load_config(REPO / "config" / "config.yaml")
    assert config["target"]["model"] == "toy"
    assert config["server"]["mode"] == "managed"


@pytest.mark.parametrize(("bad", "key"), BAD_CONFIGS, ids=[k for _, k in BAD_CONFIGS])
def test_bad_config_names_the_key(bad, key):
    with pytest.raises(ConfigError) as err:
        validate_config(bad)
    assert f"'{key}'" in str(err.value)


def test_invalid_config_report():
    """Every bad config is refused, each naming its key; the counts are printed as a report."""
    refused: dict[str, int] = {}
    for bad, key in BAD_CONFIGS:
        try:
            validate_config(bad)
        except ConfigError as err:
            named = f"'{key}'" in str(err)
            refused[key] = refused.get(key, 0) + named
    print(f"invalid configs: {len(BAD_CONFIGS)}, refused naming the key: "
          f"{sum(refused.values())}, distinct keys: {len(refused)}")
    for key, count in sorted(refused.items()):
        print(f"  {key:40s} {count}")
    assert len(BAD_CONFIGS) >= 20
    assert sum(refused.values()) == len(BAD_CONFIGS) and len(refused) >= 20


def _snakemake_dry_run(config_path, cwd):
    exe = shutil.which("snakemake", path=str(REPO / ".venv" / "bin")) or shutil.which("snakemake")
    if exe is None:
        exe = [sys.executable, "-m", "snakemake"]
    else:
        exe = [exe]
    return subprocess.run(
        [*exe, "-n", "--snakefile", str(REPO / "Snakefile"), "--configfile", str(config_path),
         "--directory", str(cwd)],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(("bad", "key"), [
    ({"generate": {"temperature": "hot"}}, "temperature"),
    ({"bogus_section": {}}, "bogus_section"),
    ({"prompts": {"sources": [{"path": "missing.jsonl"}]}}, "prompts.sources[0].path"),
    ({"hidden": {"layer_ids": [30, 2, 16]}}, "hidden.layer_ids"),
    # the library's semantic check, not a copy of it: a missing local target is refused too
    ({"target": {"model": "./no-such-model"}}, "target.model"),
])
def test_snakemake_stops_bad_config_before_any_job(tmp_path, bad, key):
    config_path = tmp_path / "bad.yaml"
    config_path.write_text(yaml.safe_dump(bad))
    result = _snakemake_dry_run(config_path, tmp_path)
    assert result.returncode != 0
    assert key in result.stdout + result.stderr
    assert not (tmp_path / "results").exists()


def test_snakemake_dry_run_lists_the_pipeline(tmp_path):
    config_path = tmp_path / "config.yaml"
    config_path.write_text((REPO / "config" / "config.yaml").read_text())
    result = _snakemake_dry_run(config_path, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    jobs = Counter(re.findall(r"^(?:local)?rule (\w+):$", result.stdout, re.M))
    # one job per rule: one generate job answers every prompt shard (the shipped config has 2)
    assert jobs == {"toy_target": 1, "prompt_shards": 1, "concurrency_profile": 1,
                    "generate": 1, "generation_summary": 1, "dataset": 1, "vocab_map": 1,
                    "hidden_states": 1, "train_draft": 1, "export_draft": 1, "bench": 1,
                    "bundle": 1, "all": 1}
    # and the list above is every rule the workflow declares: a new rule must join the run
    declared = re.findall(r"^(?:local)?rule (\w+):", "".join(
        p.read_text() for p in [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]),
        re.M)
    # the built-in targets' rules, each defined only when target.model names it: the toy's here
    assert sorted([*declared, "toy_target"]) == sorted(jobs)
    built_in = re.findall(r"^\s+rule (\w+):", (REPO / "rules" / "target.smk").read_text(), re.M)
    assert sorted(built_in) == sorted(t.rule for t in BUILTIN_TARGETS.values())


def test_every_rules_log_lies_under_its_results_folder(tmp_path):
    """Two runs into two results folders (the toy's and a real target's, say) keep their own
    logs: none is written beside the checkout, where the second run would overwrite the
    first's."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["results"] = "runs/first"
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    result = _snakemake_dry_run(config_path, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    logs = re.findall(r"^\s+log: (\S+)$", result.stdout, re.M)
    assert len(logs) == 12  # every job but `all`
    assert [p for p in logs if not p.startswith("runs/first/logs/")] == []
    assert "runs/first/logs/train_draft/train.log" in logs


def test_snakemake_builds_a_builtin_target_for_the_stages(tmp_path):
    """With target.model smollm2-135m its rule, not the toy's, makes <results>/target."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"]["model"] = "smollm2-135m"
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    result = _snakemake_dry_run(config_path, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    jobs = re.findall(r"^(?:local)?rule (\w+):$", result.stdout, re.M)
    assert "smollm2_target" in jobs and "toy_target" not in jobs
    target = result.stdout.split("rule smollm2_target:")[1].split("\n\n")[0]
    assert "output: results/target" in target
    generate = result.stdout.split("rule generate:")[1].split("\n\n")[0]
    assert "results/target" in generate  # an input of the stages that load it


# ---------------------------------------------------------------------- the config as documentation


def test_every_config_key_has_a_description():
    from draftline.core.config_docs import undocumented

    assert undocumented() == []


def test_config_readme_is_generated_from_the_schema_and_current(tmp_path):
    """config/README.md is what `draftline config-docs` writes from the schema: one row per
    key with its type, default and description."""
    from draftline.cli import main
    from draftline.core.config import load_schema
    from draftline.core.config_docs import leaves

    committed = (REPO / "config" / "README.md").read_text()
    written = tmp_path / "README.md"
    assert main(["config-docs", "--out", str(written)]) == 0
    assert written.read_text() == committed, "config/README.md is stale: run draftline config-docs"
    assert main(["config-docs", "--check", "--out", str(written)]) == 0
    written.write_text(committed.replace("retries", "tries"))
    assert main(["config-docs", "--check", "--out", str(written)]) == 1
    for key, _ in leaves(load_schema()):
        assert f"| `{key}` |" in committed
    assert "| `generate.max_retries` | integer, 0 to 100 | `6` | retries of a request" in committed


# ---------------------------------------------------------------- defaults only from the schema


def test_a_section_alone_takes_the_schema_defaults():
    """Library calls made with one section (a toy build, a training run) fill and check it from
    the schema, as the whole config is: no second copy of the defaults to drift."""
    from draftline.core.config import load_schema, resolve_section

    schema = load_schema()["properties"]
    toy = resolve_section("target.toy", {"train_steps": 0})
    assert toy == {**{k: v["default"] for k, v in
                      schema["target"]["properties"]["toy"]["properties"].items()},
                   "train_steps": 0}
    assert resolve_section("train", None)["ttt_steps"] == \
        schema["train"]["properties"]["ttt_steps"]["default"]
    assert load_config(REPO / "config" / "config.yaml")["target"]["toy"] == \
        resolve_section("target.toy", target_settings("toy")["target"]["toy"])


@pytest.mark.parametrize(("section", "values", "key"), [
    ("target.toy", {"layers": 3}, "target.toy.layers"),
    ("target.toy", {"num_heads": 0}, "target.toy.num_heads"),
    ("train", {"lr": -1}, "train.lr"),
])
def test_a_bad_section_names_its_key(section, values, key):
    from draftline.core.config import resolve_section

    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        resolve_section(section, values)


@pytest.mark.parametrize(("overrides", "key"), [
    ({"hidden.online.external_url": "http://gpu-host:8000"}, "hidden.online.spool_dir"),
    ({"hidden.online.spool_dir": "/shared/spool"}, "hidden.online.spool_dir"),
    ({"hidden.mode": "online", "hidden.backend": "vllm", "server.launcher": "docker",
      "server.image": "vllm@sha256:" + "0" * 64}, "server.launcher"),
])
def test_the_vllm_producers_server_keys_are_checked(overrides, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_config(REPO / "config" / "config.yaml", overrides)


def test_online_mode_takes_the_vllm_producer():
    config = load_config(REPO / "config" / "config.yaml",
                         {"hidden.mode": "online", "hidden.backend": "vllm"})
    assert (config["hidden"]["backend"], config["hidden"]["mode"]) == ("vllm", "online")
    external = load_config(REPO / "config" / "config.yaml", {
        "hidden.mode": "online", "hidden.backend": "vllm", "server.launcher": "docker",
        "server.image": "vllm@sha256:" + "0" * 64,
        "hidden.online.external_url": "http://gpu-host:8000",
        "hidden.online.spool_dir": "/shared/spool"})
    assert external["hidden"]["online"]["spool_dir"] == "/shared/spool"


# ----------------------------------------------------------------------------- one resolution

# The README's "Your own target" example, as a user writes it.
OWN_TARGET = {
    "target": {"model": "Qwen/Qwen3-8B", "revision": None, "trust_remote_code": False},
    "server": {"reasoning_parser": "qwen3"},
    "prompts": {"sources": [{"path": "hf:HuggingFaceH4/ultrachat_200k", "split": "train_sft",
                             "prompt_field": "prompt"}], "max_samples": 5000},
    "hidden": {"backend": "vllm"},
}


def _snakemake_config(workdir, *configfiles):
    """The config Snakemake's rules read, after every layer and validation (a probe workflow
    that includes the real Snakefile and prints it)."""
    probe = workdir / "probe.smk"
    probe.write_text(f'include: "{REPO / "Snakefile"}"\n\nimport json as _json\n'
                     'print("CONFIG", _json.dumps(config))\n')
    args = ["--configfile", *map(str, configfiles)] if configfiles else []
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(probe), "--directory", str(workdir),
         "--cores", "1", *args], capture_output=True, text=True, timeout=300, cwd=workdir)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("CONFIG ")), None)
    assert line, (result.stdout + result.stderr)[-3000:]
    return json.loads(line.removeprefix("CONFIG "))


@pytest.mark.parametrize("case", ["toy", "own target", "production"])
def test_the_cli_and_snakemake_resolve_the_same_config(tmp_path, monkeypatch, case):
    """`draftline plan --config F` (and every stage) resolves what `snakemake --configfile F`
    hands its rules: config/config.yaml, then F, over the target's built-in settings."""
    (tmp_path / "config").mkdir()
    shutil.copy(REPO / "config" / "config.yaml", tmp_path / "config" / "config.yaml")
    files = {"toy": [], "production": [REPO / "config" / "kimi-k2.5.yaml"]}.get(case)
    if files is None:
        (tmp_path / "my.yaml").write_text(yaml.safe_dump(OWN_TARGET))
        files = [tmp_path / "my.yaml"]
    monkeypatch.chdir(tmp_path)
    cli = load_config(files[0] if files else None)
    assert _snakemake_config(tmp_path, *files) == json.loads(json.dumps(cli))


def test_several_config_files_resolve_as_snakemakes_configfile_list(tmp_path, monkeypatch):
    """`draftline plan --config A B` reads A then B, as `snakemake --configfile A B` does (the
    README's SmolLM2 config with a file of one's own over it)."""
    (tmp_path / "config").mkdir()
    for name in ("config.yaml", "smollm2.yaml"):
        shutil.copy(REPO / "config" / name, tmp_path / "config" / name)
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(
        {"results": "results-mine", "generate": {"answers_per_prompt": 3}}))
    files = [tmp_path / "config" / "smollm2.yaml", tmp_path / "mine.yaml"]
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["plan", "--config", *map(str, files)])
    cli = load_config(args.config)
    assert (cli["results"], cli["generate"]["answers_per_prompt"]) == ("results-mine", 3)
    assert cli["target"]["model"] == "smollm2-135m"  # from the first file
    assert _snakemake_config(tmp_path, *files) == json.loads(json.dumps(cli))


def test_the_toys_demo_settings_reach_the_toy_only(tmp_path, monkeypatch):
    """A user's own target gets the schema's defaults (a real model's), not the toy's short
    answers, small draft vocabulary and quick sweep."""
    schema = yaml.safe_load((REPO / "src" / "draftline" / "schemas" /
                             "config.schema.yaml").read_text())["properties"]
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(OWN_TARGET))
    monkeypatch.chdir(REPO)
    own = load_config(tmp_path / "my.yaml")
    toy = load_config()
    for section, key in [("generate", "max_tokens"), ("vocab", "draft_vocab_size"),
                         ("train", "epochs"), ("train", "ttt_steps"), ("server", "max_model_len"),
                         ("server", "enforce_eager"), ("profile", "levels")]:
        default = schema[section]["properties"][key]["default"]
        assert own[section][key] == default, f"{section}.{key}"
        assert toy[section][key] == target_settings("toy")[section][key], f"{section}.{key}"
    assert toy["generate"]["max_tokens"] < own["generate"]["max_tokens"]
    # a key the user sets wins over the toy's own settings
    assert load_config(overrides={"vocab.draft_vocab_size": 2048})["vocab"][
        "draft_vocab_size"] == 2048
